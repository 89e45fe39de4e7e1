"""What the simulator tells a person is true: does it fit (and what would make it fit), the cluster's useful
rate, and numbers printed in units a person reads, with no negative or sub-microsecond noise."""

from __future__ import annotations

import re

import pytest
import torch

from toolkit.models import presets, tiny_gpt
from toolkit.sim import cluster_of, simulate
from toolkit.units import bytes_text, count_text, seconds_text

MIXED = dict(mixed_precision=True, progress=False)
SMALL_GPU = dict(
    name="32 MB GPU", peak_flops={"bf16": 1e12, "fp16": 1e12, "fp32": 1e12}, memory_bytes=32e6, memory_bandwidth=1e11
)
SMALL = cluster_of(
    dict(name="small", gpu=SMALL_GPU, gpus_per_node=8, intra=("100 GB/s", "5 us"), inter=("10 GB/s", "10 us"))
)


def long_sequences():
    return tiny_gpt(n_layer=4, d_model=128, n_head=4, seq_len=512, vocab_size=128)


# --- does it fit? -----------------------------------------------------------------------------------------
def test_plain_data_parallel_gpt3_does_not_fit_is_not_priced_and_sharding_makes_it_fit():
    """The trial: GPT-3 under ddp on 512 GPUs was priced at 98.9 TFLOP/s, better than ZeRO-3, while needing
    2.79 TB per GPU. Two of its 96 layers already need more than an A100's 80 GB: no step time, and the advice
    (shard the model states) is taken and checked."""
    ddp = simulate(lambda: presets.gpt3_175b(n_layer=2), "ddp", 512, cluster="dgx-a100", warmup=False, **MIXED)
    assert ddp.fits is False and ddp.fit.peak == ddp.peak > ddp.fit.capacity == 80 * 2**30
    assert ddp.step_time is ddp.tflops_per_gpu is ddp.mfu is ddp.breakdown is None
    for text in (ddp.summary(), ddp.cost.summary()):
        assert "DOES NOT FIT" in text and "zero3 or fsdp" in text and "TFLOP/s" not in text
        assert f"{bytes_text(ddp.peak - ddp.fit.capacity)} over" in text
    zero3 = simulate(lambda: presets.gpt3_175b(n_layer=2), "zero3", 512, cluster="dgx-a100", warmup=False, **MIXED)
    assert zero3.fits and zero3.step_time > 0 and zero3.tflops_per_gpu > 0
    assert f"{bytes_text(zero3.fit.headroom)} to spare" in zero3.summary()


def test_the_advice_to_checkpoint_activations_is_what_makes_it_fit():
    fsdp = simulate(long_sequences, "fsdp", 8, batch_per_rank=4, cluster=SMALL, **MIXED)
    assert not fsdp.fits and any("activation_checkpointing=True" in a for a in fsdp.fit.advice)
    assert fsdp.fit.advice[0].startswith("activation checkpointing")  # activations are most of the peak
    checkpointed = simulate(
        long_sequences, "fsdp", 8, batch_per_rank=4, cluster=SMALL, activation_checkpointing=True, **MIXED
    )
    assert checkpointed.fits and checkpointed.step_time > 0
    # not only FSDP's: activation checkpointing is every strategy's option, and the advice says so
    zero2 = simulate(long_sequences, "zero2", 8, batch_per_rank=4, cluster=SMALL, **MIXED)
    assert not zero2.fits and zero2.fit.advice[0].startswith("activation checkpointing (activation_checkpointing=True)")
    assert simulate(
        long_sequences, "zero2", 8, batch_per_rank=4, cluster=SMALL, activation_checkpointing=True, **MIXED
    ).fits
    # checkpointing short of every block, whole: the advice is every block, says what the run has now, and fits
    six = dict(batch_per_rank=6, cluster=SMALL, **MIXED)
    for flag, now in (
        (2, "now one block in 2"),
        ("op", "now by operation"),
        ("attention", "now its core attention only"),
    ):
        part = simulate(long_sequences, "fsdp", 8, activation_checkpointing=flag, **six)
        said = f"activation checkpointing of every block (activation_checkpointing=True, {now})"
        assert not part.fits and part.fit.advice[0].startswith(said), part.fit.advice
    assert simulate(long_sequences, "fsdp", 8, activation_checkpointing=True, **six).fits


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_every_strategy_is_told_to_checkpoint_its_own_activations(strategy):
    """Not "switch to fsdp": every strategy checkpoints (activation_checkpointing=True), and once it does,
    the advice is not given again."""
    sim = simulate(long_sequences, strategy, 8, batch_per_rank=4, cluster=SMALL, **MIXED)
    tips = [a for a in sim.fit.advice if "activation_checkpointing=True" in a]
    assert not sim.fits and tips and tips[0].startswith("activation checkpointing") and "fsdp" not in tips[0]
    checkpointed = simulate(
        long_sequences, strategy, 8, batch_per_rank=4, cluster=SMALL, activation_checkpointing=True, **MIXED
    )
    assert checkpointed.peak < sim.peak
    assert not any("activation_checkpointing" in a for a in checkpointed.fit.advice)


def test_without_a_cluster_the_summary_says_how_to_know_and_this_machine_shares_its_ram():
    sim = simulate(long_sequences, "ddp", 2, **MIXED)
    assert sim.fits is None and "price it on a cluster" in sim.summary()
    from toolkit.sim.fit import capacity

    here = SMALL.with_changes(name="this-machine", gpus_per_node=4)  # its RAM (memory_bytes) shared by its ranks
    assert capacity(here, 4) == pytest.approx(8e6) and capacity(SMALL, 4) == 32e6


# --- the cluster's useful rate ----------------------------------------------------------------------------
def hot_expert(num_tokens, num_experts, top_k):
    """Half of the tokens' first choice is expert 0 (the lesson's routing)."""
    t = torch.arange(num_tokens)
    first = torch.where(t % 2 == 0, torch.zeros_like(t), t % num_experts)
    return torch.stack([first] + [(first + 1 + t % (num_experts - 1)) % num_experts for _ in range(top_k - 1)], 1)


def test_tflops_per_gpu_is_all_ranks_work_over_the_world_and_rank_0s_own_is_named():
    """The trial: shadowing made the step 1.7x faster, and tflops_per_gpu (rank 0's FLOPs / step) halved, because
    rank 0 holds the hot expert and computes most of its rows. The useful work of a dropless layer does not depend
    on where its rows are computed: plain, shadowed and balanced routings do the same work per GPU."""

    def moe(routing, **options):
        return simulate(
            lambda: presets.moe_gpt_64(n_layer=1, moe_options=dict(dropless=True, **options)),
            "ddp",
            64,
            routing=routing,
            warmup=False,
            cluster="dgx-a100",
            **MIXED,
        )

    # (the predictor's rates given: left to measure them, the layer times a GEMM, counted as the step's work)
    balanced, plain = moe(None), moe(hot_expert)
    shadow = moe(hot_expert, shadow=[0], compute_flops=312e12 * 0.52, bandwidth=25e9)
    assert balanced.useful_flops == pytest.approx(balanced.flops, rel=1e-12)  # every rank does the same
    assert plain.flops > 2 * balanced.flops and shadow.flops < balanced.flops  # rank 0's own work differs ...
    for sim in (plain, shadow):  # ... the cluster's does not
        assert sim.useful_flops == pytest.approx(balanced.flops, rel=1e-9)
        assert sim.tflops_per_gpu == pytest.approx(sim.useful_flops / sim.step_time / 1e12)
        assert sim.cost.rank_tflops == pytest.approx(sim.flops / sim.step_time / 1e12)
        assert f"rank 0's own: {sim.cost.rank_tflops:.3g}" in sim.cost.summary()
    assert shadow.step_time < plain.step_time
    assert shadow.tflops_per_gpu / plain.tflops_per_gpu == pytest.approx(plain.step_time / shadow.step_time)
    assert "the average rank's" in plain.summary() and "the average rank's" not in balanced.summary()


def test_mfu_is_explained_by_the_rate_compute_is_charged_at_and_the_share_of_the_step_spent_at_it():
    """The trial read "100% of peak" next to "MFU 70%": the summary now multiplies out to its MFU."""
    sim = simulate(
        long_sequences, "fsdp", 8, batch_per_rank=4, activation_checkpointing=True, cluster="dgx-a100", mfu=1.0, **MIXED
    )
    text = sim.cost.summary()
    found = re.search(
        r"MFU ([\d.]+)% = ([\d.]+)% of the bf16 peak .* x ([\d.]+)% of the step computing"
        r"(?: x ([\d.]+) \(model FLOPs, 3 x the forward's, over the FLOPs run)?",
        text,
    )
    mfu, rate, share = (float(x) for x in found.groups()[:3])
    useful = float(found.group(4) or 1)
    assert useful < 1  # checkpointing recomputes the forward: model FLOPs are fewer than the FLOPs run
    assert 0 < rate <= 100 and mfu == pytest.approx(sim.mfu * 100, abs=0.05)  # a small model: launches and memory
    printed = found.groups()[:3] + ((found.group(4),) if found.group(4) else ())
    rounding = sum(0.5 * 10 ** -len(x.partition(".")[2]) / float(x) for x in printed)  # each half a last digit
    assert mfu == pytest.approx(rate * share * useful / 100, rel=rounding)


# --- numbers as a person reads them -----------------------------------------------------------------------
def test_units_follow_the_magnitude_and_noise_is_not_printed():
    assert [bytes_text(n) for n in (0, 106, 2.05e4, 1.77e10, 2.79e12)] == [
        "0 B",
        "106 B",
        "20.5 kB",
        "17.7 GB",
        "2.79 TB",
    ]
    assert [count_text(n) for n in (12, 1.06e5, 7.5e9, 1.746e11)] == ["12", "106K", "7.5B", "175B"]
    assert [seconds_text(s) for s in (3.47e-18, -3.5e-15, 4.2e-6, 0.0309, 12.5)] == [
        "0 µs",
        "0 µs",
        "4.2 µs",
        "30.9 ms",
        "12.5 s",
    ]
    tiny = simulate(
        lambda: tiny_gpt(n_layer=1, d_model=8, n_head=2, vocab_size=16), "ddp", 2, cluster="dgx-a100", **MIXED
    )
    printed = tiny.summary() + "\n" + tiny.cost.summary()
    assert not re.search(r"\b0\.000|e-1\d|-\d+(\.\d+)? ?(ms|µs|s)\b|\d\.\d+B parameters", printed), printed
    assert "K parameters" in printed and " kB" in printed


def test_a_modelled_timeline_says_as_much_overlap_as_the_cost_model():
    """The trial: "30.9 ms exposed" next to a timeline saying "100% overlapped". Where the cores do a collective's
    copies (overlap < 1, as on a CPU), that time is not computing, in the timeline as in the cost model."""
    from toolkit import viz

    cores = cluster_of(SMALL, intra=("2 GB/s", "5 us"), overlap=0.2)
    sim = simulate(long_sequences, "fsdp", 8, cluster=cores, forward_prefetch=True, **MIXED)
    line = viz.timeline(sim.modelled_run).layout.title.subtitle.text
    shown = float(re.search(r"overlapped with computation: (\d+)%", line).group(1))
    b = sim.breakdown
    assert b["exposed_comm"] > 0.1 * sim.step_time
    assert shown == pytest.approx(100 * b["overlapped_comm"] / (b["overlapped_comm"] + b["exposed_comm"]), abs=1.5)
