"""The cost model on hand-written programs: collective times on a two-level cluster, the overlap rule,
the modelled Run read by the same tools as a real one, and clear errors for bad input."""

import json
import math

import pytest

from toolkit.memory.formulas import alpha_beta_time, fsdp_cross_host_traffic
from toolkit.sim import Collective, Compute, Wait, cluster_of, estimate, presets
from toolkit.sim.collective_time import bus_bandwidth, collective_time
from toolkit.sim.timeline import schedule
from toolkit.trace import analysis
from toolkit.trace.chrome import to_chrome

DGX = cluster_of("dgx-a100")
# a DGX A100's links as a user would write them: no published measurements, so the alpha-beta model of its links
AB = cluster_of(
    dict(
        name="dgx-like",
        gpu="a100-80gb",
        gpus_per_node=8,
        intra=("300 GB/s", "3.4 us"),
        inter=("200 Gb/s", "9.6 us"),
        call_latency="8.4 us",
    )
)
MB = 1e6


def comm(i, op, size, group, async_op=True, phase="backward", **args):
    return Collective(i, op, int(size), 0, 0, tuple(group), async_op, phase=phase, args=args)


# --- collective times ----------------------------------------------------------------------------------
def test_inside_one_node_the_ring_is_the_lessons_alpha_beta_plus_nccls_call_latency():
    """A cluster without published measurements (a user's) is priced at the alpha-beta model of its links (the
    presets' measured rates: tests/test_sim_published.py)."""
    for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"):
        got = collective_time(AB, op, 64 * MB, range(8)).seconds
        ring = alpha_beta_time(op, 64 * MB, 8, AB.intra.latency, 1 / AB.intra.bandwidth)
        assert got == pytest.approx(AB.call_latency + ring, rel=1e-12), op


def test_across_nodes_the_nics_of_a_node_add_up_and_latency_crosses_the_network_only_between_nodes():
    # 4 nodes x 8 GPUs: 8 rings at once, one per card: min(NVLink 300, 8 x 25) = 200 GB/s
    full = collective_time(AB, "all_gather", 1e9, range(32))
    assert full.bandwidth == 200e9 and full.resources == ("intra", "inter")
    assert full.latency == pytest.approx(8.4e-6 + (31 - 3) * 3.4e-6 + 3 * 9.6e-6)
    assert full.seconds == pytest.approx(full.latency + 31 / 32 * 1e9 / 200e9)
    # one GPU per node (HSDP's replicate group): a single card
    replicate = collective_time(AB, "all_reduce", 1e9, range(0, 32, 8))
    assert replicate.bandwidth == 25e9 and replicate.link == "inter-node" and replicate.resources == ("inter",)
    assert replicate.seconds == pytest.approx(8.4e-6 + 6 * 9.6e-6 + 2 * 3 / 4 * 1e9 / 25e9)


def test_hybrid_sharding_crosses_the_network_with_the_fsdp_papers_volumes():
    """Per GPU and per unit of M bytes: full sharding sends 3M(W-1)/W across nodes at 8 cards' speed,
    hybrid sharding one all-reduce of M/G over one card: the times follow the paper's 3M(W-1)/W vs
    2M(W-1)/(GW) once each is divided by its bandwidth."""
    M, W, G = 3.6e9, 512, 8
    full = sum(
        collective_time(AB, op, M, range(W)).seconds - collective_time(AB, op, M, range(W)).latency
        for op in ("all_gather", "all_gather", "reduce_scatter")
    )
    hybrid = (
        collective_time(AB, "all_reduce", M / G, range(0, W, G)).seconds
        - collective_time(AB, "all_reduce", M / G, range(0, W, G)).latency
    )
    assert full == pytest.approx(fsdp_cross_host_traffic(M, G, W, "full_shard") / (G * 25e9), rel=1e-9)
    # the replicate ring has W/G members: (W/G-1)/(W/G) against the paper's (W-1)/W, 1.4% apart at W=512
    assert hybrid == pytest.approx(fsdp_cross_host_traffic(M, G, W, "hybrid") / 25e9, rel=2e-2)
    assert hybrid < full


def test_all_to_all_sends_each_peer_over_its_own_kind_of_link():
    rows = [10] * 16  # 16 ranks on 2 nodes, 10 rows of 1 kB to every rank
    cost = collective_time(AB, "all_to_all", 160e3, range(16), me=3, args=dict(input_splits=rows, output_splits=rows))
    intra, inter = 7 * 10e3 / 300e9, 8 * 10e3 / 25e9
    assert cost.seconds == pytest.approx(8.4e-6 + 7 * 3.4e-6 + 8 * 9.6e-6 + max(intra, inter))
    assert collective_time(AB, "all_reduce", 1e6, [5]).seconds == 0.0  # a group of one moves nothing


# --- the overlap rule ----------------------------------------------------------------------------------
def fixed(seconds):
    return lambda c: seconds[c.label] if isinstance(c, Compute) else None


class Cost:
    def __init__(self, seconds, resources=("link",)):
        self.seconds, self.resources = seconds, resources


def test_async_collective_hides_behind_the_compute_issued_after_it_and_a_wait_stalls():
    program = [
        Compute(0, label="a"),
        comm(0, "all_reduce", 1, [0, 1]),
        Compute(0, label="b"),
        Wait(0),
        Compute(0, label="c"),
    ]
    t = schedule(program, fixed({"a": 1.0, "b": 0.4, "c": 1.0}), lambda c: Cost(1.0))
    assert [(s.kind, s.start, s.end) for s in t.spans] == [
        ("compute", 0.0, 1.0),
        ("comm", 1.0, 2.0),
        ("compute", 1.0, 1.4),
        ("wait", 1.4, 2.0),
        ("compute", 2.0, 3.0),
    ]
    assert t.breakdown() == pytest.approx(dict(compute=2.4, exposed_comm=0.6, overlapped_comm=0.4, step=3.0))


def test_where_the_cores_do_the_copies_an_async_collective_hides_only_its_overlap_fraction():
    """A CPU's collectives run on the cores the ranks compute on (`Cluster.overlap` < 1, measured by the
    calibration): an asynchronous one then costs what a synchronous one does at overlap 0, and a synchronous
    one costs the same whatever the fraction; the GPU presets keep separate links (overlap 1)."""
    program = [
        Compute(0, label="a"),
        comm(0, "all_reduce", 1, [0, 1]),
        Compute(0, label="b"),
        Wait(0),
        Compute(0, label="c"),
    ]
    sync = [
        Compute(0, label="a"),
        comm(0, "all_reduce", 1, [0, 1], async_op=False),
        Wait(0),
        Compute(0, label="b"),
        Compute(0, label="c"),
    ]
    times = fixed({"a": 1.0, "b": 0.8, "c": 1.0})
    step = {f: schedule(program, times, lambda c: Cost(1.0), overlap=f).breakdown() for f in (0.0, 0.5, 1.0)}
    assert [step[f]["step"] for f in (1.0, 0.5, 0.0)] == pytest.approx([3.0, 3.3, 3.8])
    assert step[0.0] == pytest.approx(schedule(sync, times, lambda c: Cost(1.0)).breakdown())
    assert step[0.0]["overlapped_comm"] == 0.0 and step[0.5]["exposed_comm"] == pytest.approx(0.5)
    for f in (0.0, 0.5):
        assert schedule(sync, times, lambda c: Cost(1.0), overlap=f).step_time == pytest.approx(3.8)
    assert DGX.overlap == 1.0 and cluster_of("dgx-h100").overlap == 1.0
    with pytest.raises(ValueError, match=r"overlap=1.5 .* in \[0, 1\]"):
        cluster_of("dgx-a100", overlap=1.5)


def test_where_latency_is_delay_in_flight_the_next_message_leaves_while_the_last_ones_latency_runs():
    """The emulated link holds its card for a message's bytes only (`toolkit.comm.cost`); a cluster that says
    so (`latency_holds_link=False`, what calibration gives an emulated link) lets four pipelined all-to-alls
    pay their bytes in turn and their latencies in flight: the emulator's own ledger agrees to the nanosecond.
    NCCL's presets keep the whole time on the link (four latencies in turn)."""
    from toolkit.comm.cost import Ledger, demand
    from toolkit.comm.cost import schedule as book
    from toolkit.comm.emulate import Link, Settings

    link = Link(20e6, 0.5e-3)
    emulated = cluster_of(
        "dgx-a100", gpus_per_node=1, inter=link, intra=link, call_latency=0.0, latency_holds_link=False, published=None
    )
    program = [comm(i, "all_to_all", 256e3, [0, 1]) for i in range(4)] + [Wait(i) for i in range(4)]
    one = collective_time(emulated, "all_to_all", 256e3, [0, 1], me=0)
    assert one.occupancy == pytest.approx(one.seconds - 0.5e-3)
    step = schedule(program, None, lambda c: collective_time(emulated, c.op, c.size_bytes, c.group, me=0)).step_time
    ledger, settings = Ledger(), Settings(link)
    emulator = max(
        book(ledger, ledger, settings, demand(settings, "all_to_all", [0, 1], 0, 256e3), 0, 0.0) for _ in range(4)
    )
    assert step == pytest.approx(emulator, abs=1e-9) == pytest.approx(4 * one.seconds - 3 * 0.5e-3)
    nccl = emulated.with_changes(latency_holds_link=True)
    held = schedule(program, None, lambda c: collective_time(nccl, c.op, c.size_bytes, c.group, me=0)).step_time
    assert held == pytest.approx(4 * one.seconds)


def test_collectives_on_one_link_take_turns_and_on_different_links_run_side_by_side():
    program = [comm(0, "all_gather", 1, [0, 1]), comm(1, "all_reduce", 1, [0, 1]), Wait(0), Wait(1)]
    same = schedule(program, None, lambda c: Cost(1.0))
    apart = schedule(program, None, lambda c: Cost(1.0, ("intra",) if c.op == "all_gather" else ("inter",)))
    assert same.step_time == 2.0 and apart.step_time == 1.0
    assert same.breakdown()["exposed_comm"] == 2.0 and same.breakdown()["overlapped_comm"] == 0.0


def test_a_ring_the_network_bounds_holds_nvlink_only_for_its_bytes_time_there():
    """A data-parallel reduce-scatter across nodes runs at the network's pace; its bytes cross NVLink in a fraction of
    that. A tensor-parallel all-reduce inside the node (another communicator: NCCL runs the two side by side) waits
    only for that fraction, not for the whole reduce-scatter (where the links share, as on the GPU presets, not at
    all); a second collective of the reduce-scatter's communicator waits for it either way."""
    for cluster in (AB, cluster_of("dgx-h100", links_share=False), cluster_of("dgx-h100")):
        across = collective_time(cluster, "reduce_scatter", 1e9, range(0, 32, 2))  # 4 nodes, 4 members on each
        inside = collective_time(cluster, "all_reduce", 8 * MB, range(4))
        nvlink = bus_bandwidth(cluster, "reduce_scatter", 1e9) if cluster.published else cluster.intra.bandwidth
        assert across.resources == ("intra", "inter") and across.bandwidth < nvlink
        assert across.occupancy_on("intra") == pytest.approx(15 / 16 * 1e9 / nvlink)  # its bytes at NVLink's rate
        assert across.occupancy_on("intra") < across.occupancy_on("inter") == across.seconds
        assert inside.occupancy_on("intra") == inside.seconds and inside.intra_seconds is None
        program = [comm(0, "reduce_scatter", 1e9, range(0, 32, 2)), comm(1, "all_reduce", 8 * MB, range(4))]
        program += [comm(2, "all_gather", 1e9, range(0, 32, 2)), Wait(0), Wait(1), Wait(2)]
        spans = schedule(
            program, None, lambda c, cluster=cluster: collective_time(cluster, c.op, c.size_bytes, c.group)
        ).spans
        (rs, ar, ag) = [next(s for s in spans if s.kind == "comm" and s.instruction.id == i) for i in range(3)]
        beside = 0.0 if cluster.links_share else across.occupancy_on("intra")
        assert ar.start == pytest.approx(beside) and ar.end < rs.end  # beside it
        assert ag.start == pytest.approx(rs.end)  # one communicator's collectives in turn
    exchange = collective_time(cluster_of("dgx-h100"), "all_to_all", 16 * MB, range(16), me=0)  # 7 peers by NVLink
    assert exchange.resources == ("intra", "inter") and 0 < exchange.occupancy_on("intra") < exchange.seconds / 2


def test_links_that_share_run_a_short_collective_beside_a_long_one_and_lose_no_time():
    """With `links_share` (the GPU presets: NCCL's communicators on their own streams) a small collective of another
    communicator issued while a large one crosses the network starts at once and the two split the link's rate: the
    small one's bytes take twice their time (not the large one's remaining time plus their own, as when links take
    turns), the large one ends later by exactly the small one's bytes' time, and a third issued once both are done
    starts when it would with turns: the link's work is the same, only its order differs. A collective of the large
    one's own communicator waits for it, as NCCL runs one communicator's collectives in turn."""
    turns, shared = cluster_of("dgx-h100", links_share=False), cluster_of("dgx-h100")
    nodes, half = range(0, 128, 8), range(0, 64, 8)  # one rank on each of 16 (8) nodes: the network alone
    program = [comm(0, "all_gather", 1e9, nodes), comm(1, "all_reduce", 4 * MB, half)]
    program += [Wait(1), Wait(0), comm(2, "all_gather", 1e9, nodes), comm(3, "all_reduce", 4 * MB, nodes), Wait(3)]

    def spans(cluster):
        out = schedule(program, None, lambda c: collective_time(cluster, c.op, c.size_bytes, c.group))
        return [next(s for s in out.spans if s.kind == "comm" and s.instruction.id == i) for i in range(4)]

    big, small = collective_time(shared, "all_gather", 1e9, nodes), collective_time(shared, "all_reduce", 4 * MB, half)
    assert big.resources == small.resources == ("inter",) and small.occupancy_on("inter") < big.seconds / 10
    (g0, r0, a0, s0), (g1, r1, a1, s1) = spans(turns), spans(shared)
    assert r0.start == pytest.approx(g0.end) and a0.start == pytest.approx(r0.end)  # turns: behind the gather
    assert r1.start == 0 and r1.end == pytest.approx(small.seconds + small.occupancy_on("inter"))  # beside it
    assert g1.end == pytest.approx(big.seconds + small.occupancy_on("inter"))  # delayed by its bytes' time
    assert r1.end < r0.end / 10 and a1.start == pytest.approx(a0.start)  # the same work on the link
    assert s1.start == pytest.approx(a1.end) and s1.start == pytest.approx(s0.start)  # its communicator's turn
    queued = [comm(0, "all_gather", 1e9, nodes), comm(1, "all_reduce", 4 * MB, nodes)]  # the second queued...
    queued += [comm(2, "all_reduce", 4 * MB, half), Wait(0), Wait(1), Wait(2)]  # ...when another communicator comes
    out = schedule(queued, None, lambda c: collective_time(shared, c.op, c.size_bytes, c.group)).spans
    g, q, r = [next(s for s in out if s.kind == "comm" and s.instruction.id == i) for i in range(3)]
    assert g.end == pytest.approx(g1.end) and q.start == pytest.approx(g.end)  # moved back with the gather's end
    with pytest.raises(ValueError, match="links_share"):
        cluster_of("dgx-h100", links_share="yes")


def test_buckets_beat_one_all_reduce_after_backward_and_the_model_says_by_how_much():
    """DDP's point: four buckets issued as backward produces them hide all but the last one."""
    layer = Compute(1e12, phase="backward", label="layer")
    grads = 400 * MB
    one = [layer] * 4 + [comm(0, "all_reduce", grads, range(8), async_op=False), Wait(0, "backward")]
    buckets = []
    for i in range(4):
        buckets += [layer, comm(i, "all_reduce", grads / 4, range(8))]
    buckets += [Wait(i, "backward") for i in range(4)]
    naive, ddp = estimate([one], AB, world_size=8), estimate([buckets], AB, world_size=8)
    layer_s = 1e12 / 312e12  # no operations recorded (a hand-written segment): one roofline at the datasheet peak
    bucket_s = collective_time(AB, "all_reduce", grads / 4, range(8)).seconds
    assert naive.step_time == pytest.approx(4 * layer_s + collective_time(AB, "all_reduce", grads, range(8)).seconds)
    assert ddp.step_time == pytest.approx(4 * layer_s + bucket_s)  # only the last bucket is exposed
    assert ddp.breakdown["overlapped_comm"] == pytest.approx(3 * bucket_s)
    assert ddp.tflops_per_gpu == pytest.approx(4e12 / ddp.step_time / 1e12)
    assert ddp.hfu == pytest.approx(ddp.tflops_per_gpu * 1e12 / 312e12)


def test_an_mfu_override_charges_compute_at_that_fraction():
    program = [Compute(312e12, phase="forward")]
    assert estimate([program], DGX, world_size=8, mfu=0.25).step_time == pytest.approx(4.0)
    assert estimate([program], DGX, world_size=8, dtype="fp32", mfu=1.0).step_time == pytest.approx(312 / 19.5)


# --- the modelled Run ----------------------------------------------------------------------------------
def fsdp_like_program(units=3, phase_of=("forward", "backward")):
    """All-gather each unit ahead of its compute (prefetch one), reduce-scatter after backward."""
    program, i, group = [], 0, range(16)
    for phase in phase_of:
        gathers = []
        for u in range(units):
            program.append(comm(i, "all_gather", 200 * MB, group, phase=phase, unit=f"block{u}"))
            gathers.append(i)
            i += 1
        for u, g in enumerate(gathers):
            program += [Wait(g, phase), Compute(5e13, phase=phase, label=f"block{u}", ops=40)]
            if phase == "backward":
                program += [comm(i, "reduce_scatter", 200 * MB, group, phase=phase)]
                i += 1
        if phase == "backward":
            program += [Wait(j, phase) for j in range(i - units, i)]
    return program + [Compute(1e11, phase="optimizer", label="optimizer")]


def test_the_modelled_run_has_a_real_runs_spans_and_the_trace_tools_read_it(tmp_path):
    cost = estimate([fsdp_like_program(), fsdp_like_program()], "dgx-a100", world_size=16, rank=3)
    run = cost.run
    names = [e["name"] for e in run.events if e["cat"] == "compute"]
    assert names == ["forward", "backward", "optimizer"] * 2
    assert all(e["args"]["modelled"] for e in run.events) and run.meta["modelled"]
    assert {e["rank"] for e in run.events} == {3}
    assert len(analysis.step_windows(run, 3)) == 2
    sent = analysis.bytes_per_step(run, 3)
    assert sent[0] == sent[1]
    assert 0 < analysis.overlap_fraction(run) < 1
    # the step split agrees with what the trace tools measure on the modelled spans
    window = analysis.step_windows(run, 3)[1]
    assert window[1] - window[0] == pytest.approx(cost.step_time)
    assert [v for _, v in run.metric("step_time")] == pytest.approx(cost.step_times)
    chrome = json.loads(json.dumps(to_chrome(run), default=str))
    assert any(e.get("name") == "all_gather" and e["args"]["modelled"] for e in chrome["traceEvents"])
    run.save(tmp_path / "run.json")
    from toolkit import Run
    from toolkit.viz import timeline

    fig = timeline(Run.load(tmp_path / "run.json"))
    assert sum(len(t.x) for t in fig.data) == len(run.events)  # every modelled span is drawn


# --- bad input -----------------------------------------------------------------------------------------
def test_bad_input_gets_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown cluster preset 'dgx-b200'.*'dgx-a100', 'dgx-h100', 'this-machine'"):
        cluster_of("dgx-b200")
    with pytest.raises(ValueError, match=r"missing \['inter'\]"):
        cluster_of(dict(name="mine", gpu="a100-80gb", gpus_per_node=8, intra=("300 GB/s", "3 us")))
    with pytest.raises(ValueError, match=r"missing \['memory_bandwidth'\]"):
        cluster_of(
            dict(
                name="mine",
                gpu=dict(name="x", peak_flops={"bf16": 1e15}, memory_bytes=1e10),
                gpus_per_node=4,
                intra=("300 GB/s", "3 us"),
                inter=("100 Gb/s", "10 us"),
            )
        )
    with pytest.raises(ValueError, match=r"world_size=12 does not fill whole nodes of 8 GPUs.*multiple of 8"):
        estimate([[Compute(1.0)]], "dgx-h100", world_size=12)
    for bad in (0, 1.5, -0.1, math.nan, True):
        with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
            estimate([[Compute(1.0)]], "dgx-a100", world_size=8, mfu=bad)
    with pytest.raises(ValueError, match="waits on collective 4 before it was issued"):
        estimate([[Wait(4)]], "dgx-a100", world_size=8)
    assert set(presets()) >= {"dgx-a100", "dgx-h100", "this-machine"}
    from toolkit.models import tiny_gpt
    from toolkit.sim import simulate

    with pytest.raises(ValueError, match="unknown cluster preset 'dgx-a10'"):  # before any work is done
        simulate(tiny_gpt, "ddp", 8, cluster="dgx-a10", progress=False)
    with pytest.raises(ValueError, match=r"mfu=2: .* must be in \(0, 1\]"):
        simulate(tiny_gpt, "ddp", 8, cluster="dgx-a100", mfu=2, progress=False)


def test_a_user_defined_cluster_reads_units():
    mine = cluster_of(
        dict(
            name="fsdp-paper",
            gpu="a100-80gb",
            gpus_per_node=8,
            intra=("600 GB/s", "3.4 us"),
            inter=("250 Gb/s", "9.6 us"),
            call_latency="8.4 us",
        )
    )
    assert mine.inter.bandwidth == 31.25e9 and mine.intra.bandwidth == 600e9 and mine.call_latency == 8.4e-6
    assert cluster_of("dgx-a100", gpus_per_node=4).gpus_per_node == 4


# --- the sweep's extrapolation ------------------------------------------------------------------------------
@pytest.mark.parametrize("layers, checkpointing", [(5, False), (8, 2), (7, 2), (7, 3)])
def test_sweep_extrapolates_three_and_four_layers_to_the_whole_model(layers, checkpointing):
    """And with every k-th block checkpointed (`activation_checkpointing=k`), from two depths a period apart that
    leave the model's remainder (8 layers at k = 2: 4 and 6; 7: 3 and 5; 7 at k = 3: 4 and 7): from 3 and 4, the
    layer added is a checkpointed block alone, and 8 layers at k = 2 were priced as if 6 were recomputed."""
    import functools

    from toolkit.models import tiny_gpt
    from toolkit.sim import simulate
    from toolkit.sim.sweep import depths, sweep

    assert depths(8, 2) == (4, 6) and depths(7, 2) == (3, 5) and depths(7, 3) == (4, 7) and depths(40, 1) == (3, 4)
    model = functools.partial(tiny_gpt, d_model=64, n_head=4, vocab_size=128, seq_len=32)
    hsdp = ("fsdp", dict(sharding_group_size=8, forward_prefetch=True, activation_checkpointing=checkpointing))
    rows = sweep(model, layers=layers, strategies={"hsdp": hsdp}, worlds=(16,), batch_per_rank=2, mixed_precision=True)
    for row, (strategy, options) in zip(rows, [hsdp]):
        whole = simulate(
            lambda: model(n_layer=layers),
            strategy,
            16,
            progress=False,
            batch_per_rank=2,
            mixed_precision=True,
            cluster="dgx-a100",
            **options,
        )
        # exact up to the backward's tail: the replicas' last all-reduces overlap a little differently
        assert row["step_time"] == pytest.approx(whole.step_time, rel=1e-3), row["label"]
        assert row["flops"] == pytest.approx(whole.flops, rel=1e-9) and row["states"] == whole.memory["total"]
        assert row["peak"] == pytest.approx(whole.peak, rel=0.05)  # what is alive at the peak may shift a little
        assert row["fits"] and row["tflops_per_gpu"] == pytest.approx(whole.tflops_per_gpu, rel=1e-3)


@pytest.mark.parametrize("strategy, options", [("zero3", {}), ("fsdp", dict(activation_checkpointing=True))])
def test_at_gpt3s_width_the_peak_and_what_it_is_made_of_extrapolate_to_eight_layers(strategy, options):
    """Lesson 07 and its panel extrapolate GPT-3's 96 layers from 3 and 4: here 8, against a whole simulation.
    (From 2 layers it went wrong: a 2-layer model has no middle layer and peaks elsewhere.)"""
    from toolkit.models import presets
    from toolkit.sim import simulate
    from toolkit.sim.sweep import BASE, extrapolate

    common = dict(warmup=False, progress=False, mixed_precision=True, cluster="dgx-a100", **options)
    sims = [simulate(lambda n=n: presets.gpt3_175b(n_layer=n), strategy, 512, **common) for n in BASE]
    row = extrapolate(*sims, 8)
    whole = simulate(lambda: presets.gpt3_175b(n_layer=8), strategy, 512, **common)
    # Some of what the step makes is freed by Python's cyclic garbage collector, whenever it runs: that moves with
    # whatever ran before in the process (measured: 0.1 GB at 3 or 4 layers, so 0.5 GB extrapolated to 8). The
    # peak and what the step made (activations + temporaries) hold to that; the rest is exact.
    made = lambda parts: parts.get("activations", 0) + parts.get("temporary", 0)  # noqa: E731
    assert row["peak"] == pytest.approx(whole.peak, rel=0.03) and row["fits"] == whole.fits
    assert made(row["peak_memory"]) == pytest.approx(made(whole.peak_memory), rel=0.08)
    for category, value in whole.peak_memory.items():
        if category not in ("activations", "temporary"):
            assert row["peak_memory"][category] == pytest.approx(value, rel=0.05, abs=0.01 * whole.peak), category
    assert row["num_params"] == whole.num_params


def test_a_sweep_prints_no_negative_time_and_gives_no_rate_to_what_does_not_fit():
    """The trial: adding "ddp" to lesson 07's sweep printed "-12 ms" of exposed communication (the affine line
    below zero) and priced a model that needs 120 GB per GPU."""
    from toolkit.models import presets
    from toolkit.sim.sweep import describe, sweep

    rows = sweep(presets.zero_7_5b, layers=36, strategies={"ddp": {}}, worlds=(8,), mixed_precision=True, seq_len=1024)
    (ddp,) = rows
    assert all(v >= 0 for v in ddp["breakdown"].values())
    assert not ddp["fits"] and ddp["step_time"] is ddp["tflops_per_gpu"] is ddp["mfu"] is None
    assert ddp["states"] > 100e9 and "shard the model states" in ddp["fit"].advice[0]
    (line,) = describe(rows)
    assert line.startswith("ddp does not fit at 8 GPUs") and "TFLOP/s" not in line


def test_describe_says_a_rate_is_kept_only_when_it_is():
    """The trial: "FSDP keeps its rate" next to a plot going from 133 to 68 TFLOP/s."""
    from toolkit.sim.sweep import describe

    def rows(label, rates):
        return [
            dict(
                label=label,
                world_size=w,
                fits=True,
                tflops_per_gpu=r,
                step_time=1 / r,
                breakdown=dict(exposed_comm=0.0),
            )
            for w, r in zip((8, 1024), rates)
        ]

    (fell,) = describe(rows("fsdp", (133.4, 68.1)))
    assert fell.startswith("fsdp loses 49% of its rate: 133 TFLOP/s per GPU at 8 GPUs, 68.1 at 1024")
    assert "keeps" not in fell
    (held,) = describe(rows("hsdp", (133.4, 125.0)))
    assert held.startswith("hsdp keeps its rate")


# --- a collective beside compute (rule 5) and how far to trust a calibrated machine -------------------------
def test_an_asynchronous_collective_beside_compute_takes_beside_times_longer_and_delays_what_queues_behind():
    """ZeRO-3's backward on a CPU: a reduce-scatter in flight while the cores compute takes `beside` times its
    time, and the next all-gather on the same link starts only when it is done; a synchronous one is unchanged."""
    program = [
        comm(0, "reduce_scatter", 1, [0, 1]),
        Compute(0, label="b"),
        comm(1, "all_gather", 1, [0, 1], async_op=False),
        Wait(1),
        Wait(0),
    ]
    times = fixed({"b": 1.0})
    plain = schedule(program, times, lambda c: Cost(1.0))
    stretched = schedule(program, times, lambda c: Cost(1.0), beside=3.0)
    assert plain.step_time == 2.0  # the all-gather waits for the link until 1, ends at 2
    assert stretched.step_time == 4.0  # the reduce-scatter holds it until 3
    assert [s.end - s.start for s in stretched.spans if s.kind == "comm"] == [3.0, 1.0]


def calibration(**changes):
    """A measurement dict as `toolkit.sim.calibrate.measure` returns it (numbers made up, shapes real)."""
    links = {
        op: {"bandwidth": 1e9, "latency": 1e-4}
        for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")
    }
    return {
        "world_size": 2,
        "cores": 2,
        "host": "h",
        "measured_at": "now",
        "load": 2.0,
        "reference_spread": 0.2,
        "gemm_rates": {"fp32": [(4e6, 2e10), (5e8, 5e10)], "bf16": [(4e6, 1e9), (5e8, 1e9)]},
        "flops": {"fp32": 5e10, "bf16": 1e9},
        "op_overhead": 5e-6,
        "memory_bandwidth": 5e9,
        "reference_step_s": 0.02,
        "links": links,
        "overlap": 0.2,
        "beside_compute": {"stretch": 2.5},
        **changes,
    }


def test_a_calibrated_machine_scales_its_rates_by_the_reference_step_timed_again_and_says_how_far_to_trust_it():
    from toolkit.sim.calibrate import from_measurements
    from toolkit.sim.kernel_time import measured_rate

    now = from_measurements(calibration())
    slower = from_measurements(calibration(), reference_step_s=0.04)  # the machine runs at half speed now
    assert measured_rate(slower.gpu, 5e8, "fp32") == pytest.approx(measured_rate(now.gpu, 5e8, "fp32") / 2)
    assert slower.gpu.op_overhead == pytest.approx(2 * now.gpu.op_overhead)
    assert slower.gpu.memory_bandwidth == pytest.approx(now.gpu.memory_bandwidth / 2)
    assert slower.beside_compute == 1.0  # measured and reported, not charged (docs/benchmarks.md says why)
    # the rates are scaled so that the per-operation model reproduces the reference step it was timed on
    from toolkit.sim.calibrate import reference_seconds

    assert reference_seconds(now.gpu) == pytest.approx(0.02) and reference_seconds(slower.gpu) == pytest.approx(0.04)
    # between two measured sizes the rate is log-linear in the GEMM's FLOPs
    ratio = measured_rate(now.gpu, (4e6 * 5e8) ** 0.5, "fp32") / measured_rate(now.gpu, 4e6, "fp32")
    assert ratio == pytest.approx((5e10 / 2e10) ** 0.5)
    note = slower.notes["trust"]["note"]
    assert "load 1.0 per core" in note and "spread ±10%" in note and "0.50x as fast" in note
    cost = estimate([[Compute(1e9, label="x")]], slower, world_size=2)
    assert cost.trust == note and note in cost.summary()


def test_a_prediction_on_a_gpu_preset_says_how_its_predictions_fared_against_published_runs():
    """On the presets, `trust` is the record of published training runs (`toolkit.sim.held_to_runs`; each run held
    inside its group's range in tests/test_sim_papers.py): every group with its range, on the preset's GPU; a what-if
    on another GPU, or a cluster of one's own, states none rather than another GPU's record."""
    from toolkit.sim import held_to_runs
    from toolkit.sim.hardware import GPUS

    for name, groups in held_to_runs.PRESETS.items():
        cost = estimate([[Compute(1e12)]], name, world_size=8)
        assert cost.trust in cost.summary()
        for group in groups:
            low, high = group.took
            assert f"{group.what}: each took {low:.2f}x to {high:.2f}x the predicted step" in cost.trust
    h100 = held_to_runs.PRESETS["dgx-h100"][0]
    assert (h100.took[0] > 1.2, h100.covers(0.31), h100.covers(0.10)) == (True, True, False)  # MPT-7B's +31%
    assert estimate([[Compute(1e12)]], cluster_of("dgx-h100", inter=(100e9, "5 us")), world_size=8).trust
    other_gpu = cluster_of("dgx-h100").with_changes(gpu=GPUS["a100-80gb"])
    assert estimate([[Compute(1e12)]], other_gpu, world_size=8).trust is None


def test_a_hugging_face_models_peak_extrapolates_to_six_layers_exactly():
    """transformers' Llama, as it comes: three and four layers extrapolated moment by moment give the six-layer
    simulation's peak to the byte. Its moments are keyed by which of the model's forwards and backwards they are
    in, counted where the model itself begins; counted by the name "(model)", which Llama's submodules outside the
    named tree also get, the count grew with the depth and the extrapolation was 57% too high."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.sim import simulate
    from toolkit.sim.sweep import deepest_peak

    def at(layers):
        config = LlamaConfig(
            hidden_size=512,
            intermediate_size=1408,
            num_hidden_layers=layers,
            num_attention_heads=8,
            vocab_size=4096,
            max_position_embeddings=1024,
        )
        return simulate(
            lambda: LlamaForCausalLM(config),
            "fsdp",
            8,
            batch_per_rank=2,
            seq_len=1024,
            mixed_precision=True,
            progress=False,
        )

    three, four, six = at(3), at(4), at(6)
    assert sum(deepest_peak(three, four, lambda x, y: x + 3 * (y - x)).values()) == six.peak
