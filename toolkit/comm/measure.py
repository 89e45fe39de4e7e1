"""Measure the collectives live: time each one on real ranks, backend against hand-written, and check they agree.

Why this file exists: the lessons claim that a ring all-reduce costs 2(N-1)/N of the message per rank,
that latency dominates small messages and bandwidth large ones. Those claims are checked here by
timing the real thing, the way NCCL's own `nccl-tests` do:

- every repetition starts together (a barrier first), each rank times its own call, and the
  repetition's time is the slowest rank's (a collective is done when the last rank is done);
- the reported time is the median over repetitions (shared machines have hiccups);
- algorithm bandwidth algbw = size / time; bus bandwidth busbw = algbw x a per-operation factor that
  turns it into what each link carried, so that every collective can be compared with the link speed
  (all_reduce 2(N-1)/N; reduce_scatter, all_gather, all_to_all (N-1)/N; broadcast 1).

`size` is the full buffer, as the door records it (`size_bytes`): the tensor of all_reduce and
broadcast, the input of reduce_scatter, the gathered output of all_gather, one rank's whole send
buffer for all_to_all.

Use `measure_collectives(world_size, ...)` from a notebook or script: it launches the ranks and
returns `(records, run)`. Inside ranks you already launched, call `time_collectives(...)`
(a collective: every rank must call it with the same arguments). `format_table(records)` prints them
(`measure_table.py`: the labels a table and a figure share).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ..trace import events as _events
from . import collectives as _door
from .measure_table import KiB, MiB, format_table, implementation_label, size_label, table_rows  # noqa: F401 - re-exported
from .switch import OPERATIONS, using

DEFAULT_SIZES = (4 * KiB, 64 * KiB, 1 * MiB, 4 * MiB)
QUICK_SIZES = (4 * KiB, 256 * KiB)
IMPLEMENTATIONS = ("backend", "ring")
METRIC = "collective_timing"  # the name under which rank 0 notes every record in the Run's metrics


# --- conventions ----------------------------------------------------------------------------------
def bus_factor(op: str, world_size: int) -> float:
    """busbw / algbw for `op` on `world_size` ranks (the nccl-tests convention)."""
    n = world_size
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"no bus-bandwidth factor for {op!r}; known: {OPERATIONS}.")


def handwritten_operations() -> set[str]:
    """The operations that `comm.use("ring")` replaces with hand-written code (empty until it exists)."""
    try:
        from . import alltoall, ring
    except ImportError:
        return set()
    return set(getattr(ring, "IMPLEMENTATION", {})) | set(getattr(alltoall, "IMPLEMENTATION", {}))


def algorithm_name(op: str, impl: str, backend: str) -> str:
    """What actually ran: 'gloo' / 'nccl' for the backend, 'ring' or 'pairwise' for the hand-written ones."""
    if impl == "backend":
        return backend
    return "pairwise" if op == "all_to_all" else "ring"


# --- one collective, ready to call many times --------------------------------------------------------
def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _numel_for(nbytes: int, n: int, element_size: int) -> int:
    """Elements closest to `nbytes` that split evenly over `n` ranks (at least one per rank)."""
    return max(n, (nbytes // element_size) // n * n)


def _prepare(op: str, numel: int, dtype, device, seed: int, group=None):
    """Buffers for one operation, and a `call()` that runs it through the door and returns the result.

    Inputs differ per rank (so a broken collective shows) and are reset before every call (in-place
    collectives would otherwise feed on their own output); the reset is outside the timed region.
    group: the process group it runs on (None: every rank); a broadcast comes from the group's first rank.
    """
    n, me = dist.get_world_size(group), dist.get_rank()
    first = dist.get_process_group_ranks(group)[0] if group is not None else 0
    gen = torch.Generator().manual_seed(seed * 1000 + me)
    pristine = torch.randn(numel, generator=gen).to(device=device, dtype=dtype)
    if op == "all_reduce":
        buf = torch.empty_like(pristine)
        return (lambda: buf.copy_(pristine)), (lambda: _door.all_reduce(buf, group=group)), (lambda: buf)
    if op == "broadcast":
        buf = torch.empty_like(pristine)
        return (lambda: buf.copy_(pristine)), (lambda: _door.broadcast(buf, src=first, group=group)), (lambda: buf)
    if op == "reduce_scatter":
        out = torch.empty(numel // n, device=device, dtype=dtype)
        return (lambda: None), (lambda: _door.reduce_scatter(out, pristine, group=group)), (lambda: out)
    if op == "all_gather":
        mine = pristine[: numel // n].clone()
        out = torch.empty_like(pristine)
        return (lambda: None), (lambda: _door.all_gather(out, mine, group=group)), (lambda: out)
    if op == "all_to_all":
        out = torch.empty_like(pristine)
        return (lambda: None), (lambda: _door.all_to_all(out, pristine, group=group)), (lambda: out)
    raise ValueError(f"unknown operation {op!r}; choose from {OPERATIONS}.")


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest_rank(seconds: list[float], device) -> list[float]:
    """Per repetition, the slowest rank's time (a raw gather: bookkeeping stays out of the trace)."""
    mine = torch.tensor(seconds, dtype=torch.float64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return torch.stack(everyone).max(dim=0).values.tolist()


def _all_ranks_agree(diff: float, ok: bool, device) -> tuple[float, bool]:
    both = torch.tensor([diff, 0.0 if ok else 1.0], dtype=torch.float64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return both[0].item(), both[1].item() == 0.0


# --- on every rank ---------------------------------------------------------------------------------
def time_collectives(
    ops=OPERATIONS,
    sizes=DEFAULT_SIZES,
    impls=IMPLEMENTATIONS,
    *,
    warmup: int = 2,
    repeats: int = 5,
    dtype=torch.float32,
) -> list[dict]:
    """Time every (operation, size, implementation) on this job's ranks; return the same records on every rank.

    Collective: call it on every rank with the same arguments. Each call of a timed repetition goes
    through `toolkit.comm`, so it lands on the trace, in a phase named "op/impl/size". Warm-up calls
    are kept off the trace. An implementation with no hand-written version of an operation (the ring
    has no broadcast) is skipped for that operation rather than timed twice under two names.
    Rank 0 also notes each record as a metric, so the Run it captures carries its own measurements.
    """
    unknown = set(ops) - set(OPERATIONS) or set(impls) - set(IMPLEMENTATIONS)
    if unknown:
        raise ValueError(f"unknown {sorted(unknown)}; operations: {OPERATIONS}, implementations: {IMPLEMENTATIONS}.")
    if warmup < 1 or repeats < 1:
        raise ValueError(f"warmup and repeats must be at least 1, got warmup={warmup}, repeats={repeats}.")
    n, device, backend = dist.get_world_size(), _device(), dist.get_backend()
    element_size = torch.empty(0, dtype=dtype).element_size()
    handwritten = handwritten_operations()
    recorder = _events.recorder
    records = []
    for op_index, op in enumerate(ops):
        chosen = [i for i in impls if i == "backend" or op in handwritten]
        if not chosen:
            continue
        for size_index, nbytes in enumerate(sizes):
            numel = _numel_for(int(nbytes), n, element_size)
            with recorder.span("prepare inputs", cat="compute", op=op, numel=numel):
                reset, call, result = _prepare(op, numel, dtype, device, seed=op_index * 100 + size_index)
            outputs, timed = {}, {}
            for impl in chosen:
                with using(impl):
                    was_on, recorder.enabled = recorder.enabled, False
                    try:
                        for i in range(warmup):
                            reset()
                            call()
                            if i == 0:
                                outputs[impl] = result().clone()  # the first result is the one compared
                    finally:
                        recorder.enabled = was_on
                    seconds = []
                    with _events.phase(f"{op}/{impl}/{size_label(numel * element_size)}"):
                        for _ in range(repeats):
                            reset()
                            _sync(device)
                            dist.barrier()
                            start = time.perf_counter()
                            call()
                            _sync(device)
                            seconds.append(time.perf_counter() - start)
                    timed[impl] = _slowest_rank(seconds, device)
            diff, agree = None, None
            if len(outputs) > 1:
                with recorder.span("check agreement", cat="compute", op=op, numel=numel):
                    first, *others = outputs.values()
                    diff = max((o - first).abs().max().item() for o in others)
                    ok = all(torch.allclose(o, first, rtol=1e-4, atol=1e-5) for o in others)
                diff, agree = _all_ranks_agree(diff, ok, device)
            for impl, worst in timed.items():
                record = _record(op, impl, backend, numel, element_size, dtype, n, worst, agree, diff, warmup)
                records.append(record)
                if dist.get_rank() == 0:
                    recorder.metric(METRIC, record)
    return records


def _record(op, impl, backend, numel, element_size, dtype, n, worst, agree, diff, warmup) -> dict:
    seconds = statistics.median(worst)
    size = numel * element_size
    algbw = size / seconds if seconds > 0 else float("inf")
    return {
        "op": op,
        "impl": impl,
        "algorithm": algorithm_name(op, impl, backend),
        "size_bytes": size,
        "numel": numel,
        "dtype": str(dtype).replace("torch.", ""),
        "world_size": n,
        "backend": backend,
        "seconds": seconds,
        "seconds_min": min(worst),
        "seconds_max": max(worst),
        "repeats": len(worst),
        "warmup": warmup,
        "algbw": algbw,
        "busbw": algbw * bus_factor(op, n),
        "agree": agree,
        "max_abs_diff": diff,
    }


# --- from a notebook or a script -----------------------------------------------------------------------
def _measure_on_rank(ops, sizes, impls, warmup, repeats, dtype, config):
    from toolkit.comm.measure import time_collectives
    from toolkit.run import Run
    from toolkit.trace import events

    events.recorder.reset()
    records = time_collectives(ops, sizes, impls, warmup=warmup, repeats=repeats, dtype=dtype)
    return records, Run.capture(config)


def measure_collectives(
    world_size: int = 4,
    ops=OPERATIONS,
    sizes=DEFAULT_SIZES,
    impls=IMPLEMENTATIONS,
    *,
    warmup: int = 2,
    repeats: int = 5,
    dtype=torch.float32,
    timeout_s: float = 60.0,
    quiet: bool = True,
    config: dict | None = None,
):
    """Launch `world_size` ranks, time the collectives on them, and return `(records, run)`.

    records: one dict per (operation, size, implementation): op, impl, algorithm, size_bytes, seconds
    (median over repetitions of the slowest rank), seconds_min/max, algbw and busbw (bytes/s), agree
    (backend and hand-written results match; None when only one ran), max_abs_diff, world_size, backend.
    run: the merged `toolkit.Run`; its events are the timed calls (one span per call per rank) and the
    compute spans that prepared inputs and compared results; `records_from_run(run)` gives the records back.
    """
    from ..run import Run
    from ..runtime import launch

    config = dict(
        config or {},
        kind="collectives",
        ops=list(ops),
        sizes=[int(s) for s in sizes],
        impls=list(impls),
        warmup=warmup,
        repeats=repeats,
        dtype=str(dtype).replace("torch.", ""),
    )
    results = launch(
        _measure_on_rank,
        world_size,
        args=(tuple(ops), tuple(sizes), tuple(impls), warmup, repeats, dtype, config),
        timeout_s=timeout_s,
        quiet=quiet,
    )
    return results[0][0], Run.merge(run for _, run in results)


def records_from_run(run) -> list[dict]:
    """The measurement records a Run carries (as noted by its lowest rank)."""
    return [value for _, value in run.metric(METRIC)]
