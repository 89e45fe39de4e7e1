"""The MoE rows of bench/sim_accuracy.py simulate under an emulated link, and each rank sends what a real rank sends.

An emulated link (`toolkit.comm.emulate`) books every collective on the job's store and holds it to the
modelled time; an all-to-all also waits for its senders' notes. A simulated rank has neither a store nor
peers, so the simulator's cluster keeps the link as a setting (the MoE layer decides by it, as on a real
rank) and books nothing; the cost model prices the collectives on the cluster's links instead.

Each simulated rank carries its own load: the fake all-to-all would hand every rank rank 0's counts
(`toolkit.sim.fake.alike_all_to_all`). At 4 ranks the capacity caps the hot expert, so the busiest ranks are 1 and 3.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from bench_module import load

import toolkit
from toolkit.sim import simulate
from toolkit.sim.simulate import train_step

WORLD = 4


def real_bytes(build, routing, variants, link, moe):
    """On every real rank, under the emulated link: two steps of each variant; the bytes of the second."""
    from toolkit.moe.gates import assume_routing

    rank, world = dist.get_rank(), dist.get_world_size()
    found = {}
    with toolkit.comm.emulate(**link), assume_routing(routing):
        for name, options in variants.items():
            toolkit.trace.recorder.reset()
            torch.manual_seed(0)
            model = build(world, **options)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            tokens = torch.Generator().manual_seed(rank)
            x = torch.randint(0, moe["vocab"], (moe["batch"], moe["seq_len"]), generator=tokens)
            for step in (0, 1):
                train_step(model, opt, x, x, step=step)
            run = toolkit.Run.capture({}, align=False)
            found[name] = toolkit.trace.analysis.bytes_per_step(run, rank)[-1]
    return found


@pytest.mark.timeout(120)
def test_moe_rows_simulate_under_the_emulated_link_and_send_what_a_real_run_sends(no_leftover_ranks):
    bench = load("sim_accuracy")
    link = dict(bandwidth=bench.MOE["bandwidth"], latency=bench.MOE["latency"])
    variants = bench.MOE_VARIANTS
    sims = {}
    with toolkit.comm.emulate(**link) as emulation:
        for name, options in variants.items():
            for rank in range(WORLD):
                sims[name, rank] = simulate(
                    functools.partial(bench.moe_block, WORLD, **options),
                    "local",
                    WORLD,
                    rank=rank,
                    ranks_per_node=1,
                    batch_per_rank=bench.MOE["batch"],
                    optimizer=torch.optim.SGD,
                    routing=bench.skewed,
                    progress=False,
                )
        assert toolkit.comm.emulated_link() is emulation.settings  # the setting survives the simulations
    assert {name for name, _ in sims} == {"moe plain", "moe pipeline 4", "moe shadow"}
    for (name, _), sim in sims.items():
        comm = [e for e in sim.run.events if e["cat"] == "comm"]
        assert any(e["name"] == "all_to_all" for e in comm), name
        assert not any("emulated_s" in e["args"] for e in comm), name  # nothing was booked on the fake group
    real = toolkit.launch(
        real_bytes, WORLD, args=(bench.moe_block, bench.skewed, variants, link, bench.MOE), timeout_s=90, quiet=True
    )
    for (name, rank), sim in sims.items():
        assert sim.bytes_per_phase == real[rank][name], (name, rank)
    plain = [sims["moe plain", rank].bytes_per_phase for rank in range(WORLD)]
    assert len({str(p) for p in plain}) > 1  # the ranks' loads differ: each rank was simulated with its own
