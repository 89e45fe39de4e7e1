"""Reading a trace: how long ranks communicated, how much of it hid behind compute, bytes per step.

Pure functions of a `Run`: they look only at its spans, so they work on a Run loaded from disk or made
by hand. Times are unions of intervals: two collectives in flight together count their shared time
once, which is what "time spent communicating" means to someone waiting for them.
"""

from __future__ import annotations


def _union(intervals) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same time as `intervals` (touching ones merged)."""
    merged: list[list[float]] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _length(intervals) -> float:
    return sum(e - s for s, e in intervals)


def _intersection(a, b) -> list[tuple[float, float]]:
    """Overlap of two sorted, disjoint interval lists (a two-pointer walk)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _subtract(a, b) -> list[tuple[float, float]]:
    """The parts of `a` outside `b` (both sorted and disjoint)."""
    out, j = [], 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > start:
                out.append((start, b[k][0]))
            start = max(start, b[k][1])
            k += 1
        if end > start:
            out.append((start, end))
    return out


def _spans(run, rank: int, cat: str) -> list[tuple[float, float]]:
    return _union((e["start"], e["end"]) for e in run.events if e["rank"] == rank and e["cat"] == cat)


def _blocked(run, rank: int) -> list[tuple[float, float]]:
    """When the rank could not compute: inside a synchronous collective (or a recorded "wait" span)."""
    return _union(
        (e["start"], e["end"])
        for e in run.events
        if e["rank"] == rank and (e["cat"] == "wait" or (e["cat"] == "comm" and e["args"].get("async_op") is False))
    )


def computing(run, rank: int) -> list[tuple[float, float]]:
    """Intervals during which `rank` was computing: its compute spans, less the time it was blocked.

    A compute span can contain a blocking collective (naive data parallelism all-reduces at the end of
    backward, inside the backward span); the rank waits there, it does not compute, so that time does
    not hide anything.
    """
    return _subtract(_spans(run, rank, "compute"), _blocked(run, rank))


def _ranks(run, rank):
    if rank is not None:
        return [rank]
    return sorted({e["rank"] for e in run.events})


def comm_time(run, rank: int) -> float:
    """Seconds during which `rank` had at least one collective in flight (union of its comm spans)."""
    return _length(_spans(run, rank, "comm"))


def overlap_fraction(run, rank: int | None = None) -> float:
    """Share of communication time during which the same rank was also computing, in [0, 1].

    (time communicating while computing) / (time communicating), with communication the union of the
    rank's "comm" spans and computing as in `computing` (compute spans less synchronous collectives,
    whose args say async_op=False). With `rank=None` the ranks
    are pooled: their overlapped times summed over their communication times summed.
    A run with no communication has nothing to hide: 0.0.
    """
    hidden = total = 0.0
    for r in _ranks(run, rank):
        comm = _spans(run, r, "comm")
        total += _length(comm)
        hidden += _length(_intersection(comm, computing(run, r)))
    return hidden / total if total > 0 else 0.0


def step_windows(run, rank: int) -> list[tuple[float, float]]:
    """(start, end) of each training step on `rank`, delimited by its "optimizer" compute spans.

    Step s ends where its optimizer span ends and begins where step s-1's ended; step 0 begins at the
    rank's first compute span. So everything a step causes, up to and including the optimizer's own
    collectives (ZeRO's all-gather after the update), falls inside it, and setup traffic before
    the first forward (the strategy's initial broadcast) falls outside every step.
    """
    compute = sorted((e for e in run.events if e["rank"] == rank and e["cat"] == "compute"), key=lambda e: e["start"])
    ends = [e["end"] for e in compute if e["name"] == "optimizer"]
    if not ends:
        return []
    starts = [compute[0]["start"]] + ends[:-1]
    return list(zip(starts, ends))


def bytes_per_step(run, rank: int) -> list[dict]:
    """Bytes `rank` sent in each step, by phase: [{"forward": b, "backward": b, ..., "total": b}, ...].

    A collective belongs to the step in whose window (see `step_windows`) it started; its phase is the
    label it was recorded with. Collectives outside every step (setup, teardown) are not counted.
    """
    windows = step_windows(run, rank)
    steps = [{"total": 0} for _ in windows]
    comm = sorted((e for e in run.events if e["rank"] == rank and e["cat"] == "comm"), key=lambda e: e["start"])
    s = 0
    for e in comm:
        while s < len(windows) and e["start"] > windows[s][1]:
            s += 1
        if s == len(windows):
            break
        if s == 0 and e["start"] < windows[0][0]:
            continue  # before the first step: setup
        sent = e["args"].get("bytes_sent", 0)
        steps[s][e["phase"]] = steps[s].get(e["phase"], 0) + sent
        steps[s]["total"] += sent
    return steps
