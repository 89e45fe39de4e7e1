"""The simulated rank's memory against torch's own estimate, and what watching a step must not change.

- Watching a step holds no tensor: under activation checkpointing the recomputed activations are gone when
  backward ends (FlopCounterMode's module tracker used to keep them alive: GPT-3 fsdp x512 read 59.4 GB).
- The FLOPs counted without FlopCounterMode are FlopCounterMode's own count of the same step.
- The peaks of fsdp and zero3 are within 5% of FSDP2's as FSDPMemTracker measures it on the fake process
  group (torchtitan's estimation; `bench/memory_fsdp2.py`), at small sizes the old toolkit missed by 10-20%.
"""

from __future__ import annotations

import functools
import gc

import pytest
import torch
from bench_module import load
from torch.utils.flop_counter import FlopCounterMode

from toolkit.models import tiny_gpt
from toolkit.sim import simulate
from toolkit.sim.attention import FLOPS
from toolkit.sim.cluster import cluster

TINY = functools.partial(tiny_gpt, n_layer=3)
TOLERANCE = 0.05  # the issue's target: within 5% of FSDP2's peak


def _after_backward(sim) -> dict:
    return next(s for s in sim.samples if s["phase"] == "backward")


@functools.cache
def _checkpointing(strategy: str, world: int) -> tuple:
    """(without, with) activation checkpointing: the simulations of one step of TINY, with the garbage collector
    off (what a reference cycle holds then stays held: the answer must not depend on when it runs)."""
    gc.disable()
    try:
        return tuple(
            simulate(TINY, strategy, world, activation_checkpointing=flag, progress=False) for flag in (False, True)
        )
    finally:
        gc.enable()


@pytest.mark.parametrize("strategy,world", [("ddp", 2), ("zero2", 2), ("zero3", 2), ("fsdp", 2)])
def test_checkpointing_leaves_nothing_behind_after_backward(strategy, world):
    """Every strategy checkpoints: at the end of forward it holds the bytes one process saves by checkpointing
    fewer; at the end of backward no more than without checkpointing (nothing recomputed is left alive). The
    activations themselves are one process's: data parallelism moves gradients, not activations (DDP's buckets,
    rebuilt in the measured step's forward, are gradients)."""
    plain, checkpointed = _checkpointing(strategy, world)
    alone = _checkpointing("local", 1)
    assert [s["activations"] for s in plain.samples] == [s["activations"] for s in alone[0].samples]
    saved = alone[0].samples[0]["activations"] - alone[1].samples[0]["activations"]
    assert saved > alone[1].samples[0]["activations"]  # most of the activations are recomputed
    assert plain.samples[0]["activations"] - checkpointed.samples[0]["activations"] == saved
    assert _after_backward(checkpointed)["activations"] == _after_backward(plain)["activations"]


def test_flops_are_flop_counter_modes():
    """The op counter's FLOPs (torch's flop_registry, per operation) equal FlopCounterMode's on the same step."""
    sim = simulate(TINY, "local", 1, warmup=False, progress=False)
    with cluster(1):
        with torch.device("meta"):
            model = TINY()
        x = torch.zeros((1, model.config.seq_len), dtype=torch.long, device="meta")
        with FlopCounterMode(display=False, custom_mapping=FLOPS) as counter:
            model(x, x).backward()
    assert sim.flops == counter.get_total_flops() > 0


CASES = [  # (strategy, world, model, activation checkpointing): the toolkit's ratio before the fixes
    ("fsdp", 4, dict(n_layer=3, d_model=64, n_head=2, vocab_size=256, seq_len=128), True),  # 1.205
    ("fsdp", 4, dict(n_layer=2, d_model=128, n_head=2, vocab_size=512, seq_len=32), False),  # 1.095
    ("zero3", 2, dict(n_layer=4, d_model=64, n_head=2, vocab_size=64, seq_len=8), False),  # 1.148
]


@pytest.mark.parametrize("strategy,world,model,checkpointing", CASES)
def test_peak_within_five_percent_of_fsdp2(strategy, world, model, checkpointing):
    """fsdp has FSDP2's units (every block, then the root): its peak is FSDP2's within 5% either way. zero3's
    units are single modules, less gathered at once: its peak may be lower, never more than 5% higher."""
    bench = load("memory_fsdp2")
    model_fn = functools.partial(tiny_gpt, **model)
    reference = bench.fsdp2_peak(model_fn, world, activation_checkpointing=checkpointing)["Total"]
    ratio = bench.toolkit_peak(model_fn, strategy, world, activation_checkpointing=checkpointing).peak / reference
    assert ratio <= 1 + TOLERANCE, ratio
    if strategy == "fsdp":
        assert ratio >= 1 - TOLERANCE, ratio
