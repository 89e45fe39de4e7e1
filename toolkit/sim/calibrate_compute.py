"""This machine's compute, measured on every rank at once (each rank sees its share of the cores).

What the cost model needs to price a recorded operation here (`toolkit.sim.kernel_time`, a CPU's
rules: no SMs, the host runs each operation itself):

- GEMM FLOP/s at a few shapes (fp32 and bf16), from a small product to the largest a lesson's model
  runs: a CPU's GEMM rate depends on the shape too (cache blocking, the library's packing per call),
  and the measurement is the rate itself, with no peak to take a fraction of; the shapes are timed in
  turns, so that the machine's load changes under all of them alike;
- the host cost of one operation: a tiny training step timed and divided by the aten operations it
  dispatches;
- memory bandwidth: a copy between two preallocated 8 MiB buffers;
- the reference step (a small GPT's local training step) timed several times: its spread says how
  steady the machine was while calibrating, and timing it again beside a later measurement says how
  much the machine's load has changed since (`toolkit.sim.calibrate.from_measurements`).

Every timing spans several of the scheduler's slices (`block` calls at a time), so that a rank sees
its share of the cores (ranks > cores), not a lucky or unlucky slice of them.
"""

from __future__ import annotations

import statistics
import time

REFERENCE = dict(model=dict(n_layer=2, d_model=128, n_head=4, vocab_size=256, seq_len=64), batch=8)
GEMM_SHAPES = ((128, 128, 128), (512, 128, 128), (512, 256, 512), (1024, 512, 512))  # (m, n, k), 4 MFLOP to 0.5 GFLOP
GEMM_WORK, GEMM_ROUNDS = 5e8, 7  # FLOPs per timing (tens of ms on a loaded core); rounds of every shape in turn
REFERENCE_REPEATS = 9


def timings(fn, repeats: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def spread(values) -> float:
    """The interquartile range over the median: how far one timing may sit from the typical one."""
    values = sorted(values)
    q = statistics.quantiles(values, n=4) if len(values) >= 4 else (values[0], 0, values[-1])
    return (q[2] - q[0]) / statistics.median(values)


def count_ops(fn) -> int:
    """How many aten operations `fn` dispatches, views included and collectives apart (what a program's
    `Compute.ops` counts)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from .record import _NOT_COMPUTE

    class Counter(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.calls += func.namespace not in _NOT_COMPUTE
            return func(*args, **(kwargs or {}))

    with Counter():
        fn()
    return Counter.calls


def tiny_step():
    """A training step whose arithmetic is negligible: what remains is the cost of dispatching its ops."""
    import torch

    model = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8)) for _ in range(4)]
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    return step


def reference_step(reference=REFERENCE):
    """One local training step of the reference GPT (no communication): the machine's speed, timed."""
    import torch

    from toolkit.models import SyntheticCorpus, tiny_gpt

    torch.manual_seed(0)
    model = tiny_gpt(**reference["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = SyntheticCorpus(reference["model"]["vocab_size"], reference["model"]["seq_len"], 0).batch(
        0, reference["batch"]
    )

    def step():
        model(x, y).backward()
        opt.step()
        opt.zero_grad()

    return step


def gemm_rates(dtype, overhead: float, rounds: int = GEMM_ROUNDS) -> list[tuple[float, float]]:
    """(FLOPs, FLOP/s) of one GEMM at each of GEMM_SHAPES. The shapes are timed in turns, round after round (each
    round starting at the next shape), and each one's median taken: a shared machine's load changes between two
    moments, and timed one shape after the other, a quiet moment made one point of the curve several times the
    others (62 against 11-15 GFLOP/s at 4 ranks, docs/benchmarks.md 2026-11-28), which priced a pipeline's small
    micro-batch GEMMs at a half to a third of the rate of a whole batch's larger ones. Every timing is about
    GEMM_WORK FLOPs (tens of ms on a loaded core: many of the scheduler's slices, whatever the shape)."""
    import torch

    operands = [(torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)) for m, n, k in GEMM_SHAPES]
    flops = [2 * m * n * k for m, n, k in GEMM_SHAPES]
    blocks = [max(1, round(GEMM_WORK / f)) for f in flops]
    seconds = [[] for _ in GEMM_SHAPES]
    for round_ in range(rounds + 1):  # round 0 warms up
        for i in [(round_ + j) % len(GEMM_SHAPES) for j in range(len(GEMM_SHAPES))]:
            a, b = operands[i]
            start = time.perf_counter()
            for _ in range(blocks[i]):
                a @ b
            if round_:
                seconds[i].append((time.perf_counter() - start) / blocks[i])
    return [(f, f / max(t - overhead, t / 10)) for f, t in zip(flops, map(statistics.median, seconds))]


def measure_compute(reference=REFERENCE) -> dict:
    """On every rank, all ranks at once (the caller launched them): rates, overhead, bandwidth, reference step."""
    import torch
    import torch.distributed as dist

    def together(fn, repeats, block=1):
        dist.barrier()
        return [t / block for t in timings(lambda: [fn() for _ in range(block)], repeats)]

    step = tiny_step()
    step()
    op_count = count_ops(step)
    overhead = statistics.median(together(step, 15)) / op_count
    dist.barrier()
    curves = {name: gemm_rates(dtype, overhead) for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    src, dst = torch.randn(2 * 2**20), torch.empty(2 * 2**20)  # 8 MiB each, allocated once
    bandwidth = 2 * src.numel() * 4 / statistics.median(together(lambda: dst.copy_(src), 10, block=8))
    reference_times = together(reference_step(reference), REFERENCE_REPEATS)
    return {
        "gemm_rates": curves,
        "flops": {k: max(r for _, r in v) for k, v in curves.items()},
        "op_overhead": overhead,
        "ops_in_tiny_step": op_count,
        "memory_bandwidth": bandwidth,
        "reference_step_s": statistics.median(reference_times),
        "reference_spread": spread(reference_times),
    }
