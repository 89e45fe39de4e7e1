"""What bench/sim_accuracy.py's misses pay, measured directly: small experiments on this machine's gloo ranks.

- pair: ZeRO-3's backward on loopback. After `--gap` matmuls (128 x 128), a round calls an all-gather alone, a
  reduce-scatter alone, both synchronously one after the other, or the reduce-scatter asynchronously with the
  all-gather called behind it (what ZeRO-3 without buckets does per unit). The patterns take turns, round by
  round, so the machine's load hits them alike; reported: each round's time beyond the compute alone (the slowest
  rank's median). If the asynchronous pair costs about the longer of the two, not their sum, gloo ran them at
  once (its process group's worker threads: `toolkit.sim.calibrate_links.lanes`).
- gap: one collective's cost as a function of the compute before each call (0 to 100 matmuls), the way the
  calibration measures a cost in a step (`calibrate_links.in_a_step`: a loop with calls minus one without).
- moe: the MoE layer of bench/sim_accuracy.py (pipelined, 4 chunks) under its emulated link: per rank, its
  calls' emulated time (`args.emulated_s`), the time they spent in the call, the sleep that honoured the
  emulated time (`args.emulated_sleep_s`) and the queue (`args.emulated_queue_s`). Where the sleep is small,
  the real loopback call, not the emulated link, took the time.

    python bench/sim_accuracy_mechanisms.py pair --world 4 [--gap 0] [--size 262144]
    python bench/sim_accuracy_mechanisms.py gap --world 4 [--op all_gather] [--size 65536]
    python bench/sim_accuracy_mechanisms.py moe --world 4 [--variant "moe pipeline 4"]

Every line says the machine's load average before and after (a number that moves with the load is not evidence).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import toolkit

GAPS = (0, 1, 3, 10, 30, 100)


def _load() -> float:
    return os.getloadavg()[0]


def _slowest_medians(times: dict) -> dict:
    import torch.distributed as dist

    medians = torch.tensor([statistics.median(v) for v in times.values()])
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return dict(zip(times, medians.tolist()))


# --- pair ------------------------------------------------------------------------------------------------------
def pair_on_rank(size: int, gap: int, rounds: int, calls: int) -> dict:
    import torch.distributed as dist

    from toolkit.comm import collectives as door
    from toolkit.comm.measure import _numel_for
    from toolkit.trace.events import recorder

    recorder.enabled = False
    n = dist.get_world_size()
    numel = _numel_for(size, n, 4)
    grads, shard, out, mine = torch.randn(numel), torch.empty(numel // n), torch.empty(numel), torch.randn(numel // n)
    a, b = torch.randn(128, 128), torch.randn(128, 128)
    pending = []

    def compute():
        for _ in range(gap):
            a @ b

    patterns = {
        "compute alone": compute,
        "all-gather": lambda: (compute(), door.all_gather(out, mine)),
        "reduce-scatter": lambda: (compute(), door.reduce_scatter(shard, grads)),
        "both, one after the other": lambda: (
            compute(),
            door.reduce_scatter(shard, grads),
            door.all_gather(out, mine),
        ),
        "reduce-scatter async, all-gather behind": lambda: (
            compute(),
            pending.append(door.reduce_scatter(shard, grads, async_op=True)),
            door.all_gather(out, mine),
        ),
    }
    times = {name: [] for name in patterns}
    for r in range(rounds + 1):  # the first round warms up
        for name, pattern in patterns.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                pattern()
            while pending:
                pending.pop().wait()
            if r:
                times[name].append((time.perf_counter() - start) / calls)
    return _slowest_medians(times)


def pair(world: int, size: int, gap: int) -> str:
    before = _load()
    got = toolkit.launch(pair_on_rank, world, args=(size, gap, 7, 12), timeout_s=300, quiet=True)[0]
    base = got.pop("compute alone")
    lines = [
        f"pair, world {world}, {size} B, {gap} matmuls between rounds (load {before:.1f} -> {_load():.1f}): "
        f"compute alone {base * 1e3:.2f} ms a round; beyond it:"
    ]
    lines += [f"  {name}: {(t - base) * 1e3:.2f} ms" for name, t in got.items()]
    return "\n".join(lines)


# --- gap -------------------------------------------------------------------------------------------------------
def gap_on_rank(op: str, size: int, gaps, rounds: int) -> list:
    import torch.distributed as dist

    from toolkit.comm.measure import _numel_for, _prepare
    from toolkit.sim import calibrate_links as cl
    from toolkit.trace.events import recorder

    recorder.enabled = False
    reset, call, _ = _prepare(op, _numel_for(size, dist.get_world_size(), 4), torch.float32, torch.device("cpu"), 1)
    out = []
    for g in gaps:
        cl._loop(call, reset, gaps=(g,))
        with_calls, without = [], []
        for _ in range(rounds):  # loops with and without the calls, in turns
            with_calls.append(cl._loop(call, reset, gaps=(g,)))
            without.append(cl._loop(lambda: None, reset, gaps=(g,)))
        got = _slowest_medians({"with": with_calls, "without": without})
        out.append((g, got["without"] / cl.CALLS, max(got["with"] - got["without"], 0.0) / cl.CALLS))
    return out


def gap(world: int, op: str, size: int) -> str:
    before = _load()
    rows = toolkit.launch(gap_on_rank, world, args=(op, size, GAPS, 5), timeout_s=600, quiet=True)[0]
    lines = [f"gap, world {world}, {op} of {size} B (load {before:.1f} -> {_load():.1f}):"]
    lines += [
        f"  {g} matmuls before each call ({compute * 1e3:.2f} ms of compute): {cost * 1e3:.2f} ms a call"
        for g, compute, cost in rows
    ]
    return "\n".join(lines)


# --- moe -------------------------------------------------------------------------------------------------------
def moe_on_rank(variant: str, steps: int) -> dict:
    import sim_accuracy_cases as sa
    import torch.distributed as dist
    from sim_accuracy_measure import training_step

    from toolkit.moe.gates import assume_routing
    from toolkit.trace.events import recorder

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = sa.moe_block(world, **sa.MOE_VARIANTS[variant])
    step = training_step(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(rank)
    totals = {"step": [], "calls": [], "emulated": [], "in calls": [], "slept": [], "queued": []}
    with assume_routing(sa.skewed):
        for i in range(steps):
            x = torch.randint(0, sa.MOE["vocab"], (sa.MOE["batch"], sa.MOE["seq_len"]), generator=g)
            dist.barrier()
            recorder.events.clear()
            start = time.perf_counter()
            step(x, x)
            seconds = time.perf_counter() - start
            if i < 2:  # warm-up
                continue
            calls = [e for e in recorder.events if e["cat"] == "comm"]
            args = [e["args"] for e in calls]
            totals["step"].append(seconds)
            totals["calls"].append(len(calls))
            totals["emulated"].append(sum(a.get("emulated_s", 0.0) for a in args))
            totals["in calls"].append(sum((e["end"] or e["start"]) - e["start"] for e in calls))
            totals["slept"].append(sum(a.get("emulated_sleep_s", 0.0) for a in args))
            totals["queued"].append(sum(a.get("emulated_queue_s", 0.0) for a in args))
    return {k: statistics.median(v) for k, v in totals.items()}


def moe(world: int, variant: str) -> str:
    import sim_accuracy_cases as sa

    before = _load()
    with toolkit.comm.emulate(bandwidth=sa.MOE["bandwidth"], latency=sa.MOE["latency"]):
        ranks = toolkit.launch(moe_on_rank, world, args=(variant, 8), timeout_s=600, quiet=True)
    lines = [f"moe, world {world}, {variant} (load {before:.1f} -> {_load():.1f}); per rank, medians over 6 steps:"]
    for r, t in enumerate(ranks):
        lines.append(
            f"  rank {r}: step {t['step'] * 1e3:.1f} ms, {t['calls']:.0f} calls: emulated {t['emulated'] * 1e3:.1f} "
            f"ms, in the calls (issue to return) {t['in calls'] * 1e3:.1f} ms, slept {t['slept'] * 1e3:.1f} ms, "
            f"queued {t['queued'] * 1e3:.1f} ms"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment", choices=("pair", "gap", "moe"))
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--gap", type=int, default=0, help="pair: matmuls between rounds")
    parser.add_argument("--size", type=int, default=None, help="bytes of the message (pair: 262144, gap: 65536)")
    parser.add_argument("--op", default="all_gather", help="gap: which collective")
    parser.add_argument("--variant", default="moe pipeline 4", help="moe: which of bench/sim_accuracy.py's variants")
    args = parser.parse_args(argv)
    if args.experiment == "pair":
        print(pair(args.world, args.size or 262144, args.gap))
    elif args.experiment == "gap":
        print(gap(args.world, args.op, args.size or 65536))
    else:
        print(moe(args.world, args.variant))
    return 0


if __name__ == "__main__":
    sys.exit(main())
