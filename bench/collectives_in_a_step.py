"""What each collective costs inside a real training step, from the step's own trace.

Why: `bench/sim_accuracy.py` predicts ZeRO-3 (one module at a time) at 2 ranks about 25% short. The
calibration times collectives in a loop with compute between calls; this bench reads the spans the
collectives door records during real steps and reports, per kind of call, how many there are and their
mean duration, so the two can be held side by side. All-gathers are split into forward and backward (in
backward they can queue behind asynchronous reduce-scatters on the same gloo group); an asynchronous
call's span runs from its issue to its completion, so it overlaps compute.

    python bench/collectives_in_a_step.py --strategy zero3 --world-size 2 --steps 6
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
import torch.distributed as dist

import toolkit
from toolkit import parallel
from toolkit.models import SyntheticCorpus, tiny_gpt

MODEL = dict(n_layer=4, d_model=128, n_head=4, vocab_size=256, seq_len=64)  # bench/sim_accuracy.py's
PER_RANK_BATCH = 8


def _kind(event: dict, forward_gathers: int, seen: int) -> str:
    name = event["name"]
    if name == "all_gather":
        name += " (forward)" if seen <= forward_gathers else " (backward)"
    return name + (" async" if event["args"].get("async_op") else "")


def traced_steps(strategy: str, steps: int, warmup: int = 3) -> list[dict]:
    """Per step: its wall time and {kind of call: (count, seconds)} from the recorder's comm spans."""
    rank, world = dist.get_rank(), dist.get_world_size()
    recorder = toolkit.trace.recorder
    corpus = SyntheticCorpus(vocab_size=MODEL["vocab_size"], seq_len=MODEL["seq_len"], seed=0)
    torch.manual_seed(0)
    model, opt = parallel.wrap(tiny_gpt(**MODEL), strategy)
    forward_gathers, out = None, []
    for i in range(warmup + steps):
        x, y = corpus.batch(i, PER_RANK_BATCH * world, rank=rank, world_size=world)
        recorder.events.clear()
        dist.barrier()
        start = time.perf_counter()
        loss = model(x, y)
        if forward_gathers is None:
            forward_gathers = sum(e["name"] == "all_gather" for e in recorder.events)
        loss.backward()
        opt.step()
        opt.zero_grad()
        seconds = time.perf_counter() - start
        calls, seen = collections.defaultdict(lambda: [0, 0.0]), 0
        for e in recorder.events:
            if e["cat"] != "comm" or e["end"] is None:
                continue
            seen += e["name"] == "all_gather"
            kind = calls[_kind(e, forward_gathers, seen)]
            kind[0] += 1
            kind[1] += recorder._seconds(e["end"]) - recorder._seconds(e["start"])
        if i >= warmup:
            out.append(dict(step=seconds, calls={k: tuple(v) for k, v in calls.items()}))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="zero3")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    a = parser.parse_args(argv)
    steps = toolkit.launch(traced_steps, a.world_size, args=(a.strategy, a.steps), timeout_s=300, quiet=True)[0]
    print(
        f"{a.strategy} x{a.world_size}, rank 0: median step {statistics.median(s['step'] for s in steps) * 1e3:.1f} ms"
    )
    print("| call | per step | mean ms per call (median over steps) | ms per step |")
    print("| --- | --- | --- | --- |")
    for kind in steps[0]["calls"]:
        count = steps[0]["calls"][kind][0]
        per_call = statistics.median(s["calls"][kind][1] / s["calls"][kind][0] for s in steps)
        print(f"| {kind} | {count} | {per_call * 1e3:.2f} | {per_call * count * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
