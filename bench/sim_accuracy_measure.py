"""bench/sim_accuracy.py's measurements, taken on every gloo rank: a step's time is the slowest rank's.

The cases take their steps in turn (ddp, zero1, ..., ddp, zero1, ...), and with them the calibration's
reference step, so that the shared machine's slow moments hit all of them alike; the reported time is the
median over steps.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from sim_accuracy_cases import MODEL, MOE, PER_RANK_BATCH, moe_block, skewed

import toolkit


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def training_step(model, opt):
    """A step function (x, y): forward, backward and the optimizer's step, pipelined under pp > 1."""

    def step(x, y):
        if hasattr(model, "pipeline"):  # pp > 1: the schedule runs every micro-batch's forward and backward
            model.forward_backward(x, y)
        else:
            model(x, y).backward()
        opt.step()
        opt.zero_grad()

    return step


def _in_turns(steps_by_name: dict, batches, steps: int, warmup: int) -> dict:
    """Each step function in turn on each batch (all ranks start together); median of the slowest rank's times."""
    times = {name: [] for name in steps_by_name}
    for i in range(warmup + steps):
        x, y = batches(i)
        for name, step in steps_by_name.items():
            dist.barrier()
            start = time.perf_counter()
            step(x, y)
            seconds = _slowest(time.perf_counter() - start)
            if i >= warmup:
                times[name].append(seconds)
    return {name: statistics.median(t) for name, t in times.items()}


def measure_strategies(configs, steps: int, warmup: int = 2) -> dict:
    """Median over steps of the slowest rank's step time, per config; the configs take turns, and with them
    the calibration's reference step (local, no communication), so the fitted compute rate sees the same load."""
    from toolkit import parallel
    from toolkit.models import SyntheticCorpus, tiny_gpt
    from toolkit.sim.calibrate import reference_step

    rank, world = dist.get_rank(), dist.get_world_size()
    toolkit.trace.recorder.enabled = False  # the bench times steps, not the trace
    corpus = SyntheticCorpus(vocab_size=MODEL["vocab_size"], seq_len=MODEL["seq_len"], seed=0)
    reference = reference_step()
    steps_by_name = {"reference": lambda x, y: reference()}
    for name, (strategy, options) in configs.items():
        torch.manual_seed(0)
        steps_by_name[name] = training_step(*parallel.wrap(tiny_gpt(**MODEL), strategy, **options))
    return _in_turns(
        steps_by_name, lambda i: corpus.batch(i, PER_RANK_BATCH * world, rank=rank, world_size=world), steps, warmup
    )


def measure_moe(variants, steps: int, warmup: int = 2) -> dict:
    """The MoE layer steps under the emulated link the launcher set; median slowest-rank time per variant."""
    from toolkit.moe.gates import assume_routing

    rank, world = dist.get_rank(), dist.get_world_size()
    toolkit.trace.recorder.enabled = False
    steps_by_name = {}
    for name, options in variants.items():
        torch.manual_seed(0)
        model = moe_block(world, **options)
        steps_by_name[name] = training_step(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(rank)

    def tokens(i):
        x = torch.randint(0, MOE["vocab"], (MOE["batch"], MOE["seq_len"]), generator=g)
        return x, x

    with assume_routing(skewed):
        return _in_turns(steps_by_name, tokens, steps, warmup)
