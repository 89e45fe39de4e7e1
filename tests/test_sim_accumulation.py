"""Gradient accumulation in the simulator: a step of M micro-batches, as `toolkit.train` runs it.

Bytes against the formula (`communication_per_step(..., accumulation=, no_sync=)`, written from what each strategy
keeps, not from the code), the program's shape (M forwards and backwards, the reductions where no_sync lets them
be), memory (smaller micro-batches, FSDP's whole gradients under no_sync), the price (M micro-batches' kernels, one
optimizer step) and every wrong input in the words of the interface it came in. The same steps against real gloo
ranks: tests/test_sim_vs_real.py.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from toolkit.models import tiny_gpt
from toolkit.sim import Collective, cli, simulate
from toolkit.train import TrainConfig

SMALL = dict(n_layer=2, d_model=64, n_head=4)


def small():
    return tiny_gpt(**SMALL)


@pytest.mark.parametrize("strategy", ["dp", "ddp", "zero1", "zero2", "zero3", "fsdp"])
@pytest.mark.parametrize("no_sync", [True, False])
def test_a_step_of_micro_batches_sends_what_the_formula_says(strategy, no_sync):
    if strategy == "zero1" and not no_sync:
        pytest.skip("zero1 reduces once a step by construction (refused below)")
    sim = simulate(small, strategy, 4, batch_per_rank=6, accumulation=3, no_sync=no_sync, progress=False)
    rebuilt = sim.bytes_per_step.get("broadcast", 0)  # DDP's rebuilt buckets' order, sent in its first synced step
    assert sim.bytes_per_step["total"] - rebuilt == pytest.approx(sim.theory()["bytes_per_step"], rel=1e-12)
    once = simulate(small, strategy, 4, batch_per_rank=6, progress=False)
    reductions = sum(c.op in ("all_reduce", "reduce_scatter") for c in sim.collectives())
    single = sum(c.op in ("all_reduce", "reduce_scatter") for c in once.collectives())
    holds = no_sync and strategy in ("dp", "ddp", "fsdp", "zero1")
    assert reductions == (single if holds else 3 * single), (strategy, reductions, single)


LAYOUTS = [  # tensor and context parallelism, hybrid sharding, 16-bit passes with fp32 reductions
    ("ddp", dict(tp=2)),
    ("fsdp", dict(tp=2)),
    ("zero2", dict(tp=2, mixed_precision=True)),
    ("fsdp", dict(sharding_group_size=2)),
    ("fsdp", dict(mixed_precision=dict(param_dtype="bf16", reduce_dtype="fp32"))),
    ("ddp", dict(cp=2)),
]


@pytest.mark.parametrize("strategy, options", LAYOUTS)
@pytest.mark.parametrize("no_sync", [True, False])
def test_every_layout_accumulates_as_the_formula_says(strategy, options, no_sync):
    """The tensor-parallel activations' traffic grows with the micro-batches' rows (the same in all), the replicas'
    all-reduce under hybrid sharding and the fp32 reductions count like the reduce-scatters they follow, and under
    context parallelism every micro-batch reduces its loss over the cp group."""
    sim = simulate(small, strategy, 4, batch_per_rank=4, accumulation=2, no_sync=no_sync, progress=False, **options)
    sent = sim.bytes_per_step["total"] - sim.bytes_per_step.get("broadcast", 0)
    assert sent == pytest.approx(sim.theory()["bytes_per_step"], rel=1e-12)


def test_the_program_is_three_forwards_and_backwards_then_one_optimizer_step():
    sim = simulate(small, "ddp", 2, batch_per_rank=6, accumulation=3, progress=False)
    spans = [(e["name"], e["args"].get("micro")) for e in sim.run.events if e["cat"] == "compute"]
    last = spans[-7:]  # the measured step
    assert last == [(p, m) for m in range(3) for p in ("forward", "backward")] + [("optimizer", None)], last
    reduced = [c for c in sim.collectives() if c.op == "all_reduce"]
    assert reduced and all(c.phase == "backward" for c in reduced)
    # DDP reduces during the last backward only: the collectives come after the program's third forward
    program = sim.programs[-1]
    third_forward = [i for i, c in enumerate(program) if getattr(c, "phase", "") == "forward"][-1]
    assert all(i > third_forward for i, c in enumerate(program) if isinstance(c, Collective) and c.op == "all_reduce")


def test_smaller_micro_batches_hold_fewer_activations_and_fsdps_no_sync_holds_whole_gradients():
    whole = simulate(small, "fsdp", 4, batch_per_rank=8, progress=False)
    held = simulate(small, "fsdp", 4, batch_per_rank=8, accumulation=4, progress=False)
    each = simulate(small, "fsdp", 4, batch_per_rank=8, accumulation=4, no_sync=False, progress=False)
    assert each.peak_memory["activations"] < whole.peak_memory["activations"]
    assert held.peak > each.peak  # no_sync keeps every unit's whole gradient until the last micro-batch
    assert held.memory == each.memory  # after the step: the same shards, the same optimizer states


def test_the_price_is_m_micro_batches_of_kernels_and_one_optimizer_step():
    one = simulate(small, "ddp", 8, batch_per_rank=1, cluster="dgx-a100", progress=False)
    four = simulate(small, "ddp", 8, batch_per_rank=4, accumulation=4, cluster="dgx-a100", progress=False)
    assert four.breakdown["gemm"] == pytest.approx(4 * one.breakdown["gemm"], rel=1e-9)
    assert four.breakdown["optimizer"] == pytest.approx(one.breakdown["optimizer"], rel=1e-9)
    assert four.flops == pytest.approx(4 * one.flops, rel=0.01)  # the loss / M is the difference
    assert four.step_time < 4 * one.step_time


def test_a_step_that_does_not_fit_is_told_to_accumulate_and_following_the_advice_fits():
    """Activations grow with the micro-batch, not with the step's batch: a rank's 16 sequences that do not fit in
    one pass are told the accumulation that would bring the peak down (the same batch, one optimizer step), with a
    micro-batch that divides it; run so, the step fits."""
    gpu = dict(name="small-gpu", peak_flops={"bf16": 1e14, "fp32": 2e13}, memory_bytes=700_000, memory_bandwidth=1e12)
    cluster = dict(name="small", gpu=gpu, gpus_per_node=4, intra=("100 GB/s", "2 us"), inter=("100 Gb/s", "8 us"))
    step = dict(strategy="zero3", world_size=4, batch_per_rank=16, cluster=cluster, progress=False)
    whole = simulate(tiny_gpt, **step)
    said = [a for a in whole.fit.advice if a.startswith("the same batch in smaller micro-batches")]
    assert not whole.fits and said and "now 16;" in said[0], whole.fit.advice
    accumulation = int(said[0].split("accumulation=")[1].split(",")[0])
    assert 16 % accumulation == 0 and f"{16 // accumulation} sequences a pass" in said[0]
    advised = simulate(tiny_gpt, accumulation=accumulation, **step)
    assert advised.fits and advised.peak < whole.peak / 4, (advised.peak, whole.peak)


@pytest.mark.parametrize(
    "call, message",
    [
        (dict(batch_per_rank=4, accumulation=0), "accumulation must be a positive int, got 0"),
        (dict(batch_per_rank=4, accumulation=True), "accumulation must be a positive int, got True"),
        (dict(batch_per_rank=4, accumulation=3), r"accumulation that divides it \(1, 2, 4\), or batch_per_rank=3"),
        (dict(batch_per_rank=4, accumulation=2, no_sync="no"), "no_sync must be True or False, got 'no'"),
        (dict(strategy="zero1", batch_per_rank=4, accumulation=2, no_sync=False), "drop no_sync=False, or use"),
        (dict(batch_per_rank=4, accumulation=2, pp=2), r"under pp=2 .* leave accumulation=1 \(got 2\)"),
    ],
)
def test_wrong_accumulation_is_a_clear_error_in_pythons_words(call, message):
    call = {"strategy": "ddp", **call}
    with pytest.raises(ValueError, match=message):
        simulate(small, world_size=4, progress=False, **call)
    assert not dist.is_initialized()


def test_train_config_says_the_same_in_its_own_words():
    with pytest.raises(ValueError, match="TrainConfig.no_sync must be True or False"):
        TrainConfig(accumulation=2, no_sync=None)
    with pytest.raises(ValueError, match="TrainConfig.no_sync=False: zero1 .* use strategy='zero2'"):
        TrainConfig(strategy="zero1", accumulation=2, no_sync=False)


@pytest.mark.parametrize(
    "flags, said",
    [
        ("--reduce-every-micro-batch", "--reduce-every-micro-batch is an option of gradient accumulation: add"),
        ("--batch-per-rank 4 --accumulation 3", "--batch-per-rank 4 does not split into --accumulation 3 equal"),
        ("--strategy zero1 --batch-per-rank 4 --accumulation 2 --reduce-every-micro-batch", "drop --reduce-every"),
    ],
)
def test_the_command_line_says_it_in_flags(flags, said, capsys, tmp_path):
    argv = ["--model", "tiny", "--world-size", "4", "--out", str(tmp_path), *flags.split()]
    try:
        code = cli.main(argv)
    except SystemExit as stop:
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err
    assert said in err and "no_sync" not in err and "batch_per_rank" not in err, err
