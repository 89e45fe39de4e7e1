"""Trace analysis on hand-made Runs whose answers are known exactly."""

import pytest

from toolkit.run import Run
from toolkit.trace.analysis import bytes_per_step, comm_time, computing, overlap_fraction, step_windows


def span(name, cat, start, end, rank=0, phase="idle", sent=0):
    args = {"bytes_sent": sent} if cat == "comm" else {}
    return {"name": name, "cat": cat, "phase": phase, "rank": rank, "start": start, "end": end, "args": args}


def run_of(*events):
    return Run(events=list(events), meta={"ranks": sorted({e["rank"] for e in events})})


def test_half_of_the_communication_overlaps():
    run = run_of(span("all_reduce", "comm", 0, 2), span("backward", "compute", 1, 3))
    assert overlap_fraction(run) == pytest.approx(0.5)
    assert comm_time(run, 0) == pytest.approx(2.0)


def test_overlapping_collectives_count_their_shared_time_once():
    # comm covers [0, 3] (not 4 s), compute covers [2, 2.5] and [2.8, 5]: 0.5 + 0.2 hidden of 3
    run = run_of(
        span("a", "comm", 0, 2),
        span("b", "comm", 1, 3),
        span("f", "compute", 2, 2.5),
        span("g", "compute", 2.8, 5),
        span("h", "compute", 2.9, 4),
    )
    assert comm_time(run, 0) == pytest.approx(3.0)
    assert overlap_fraction(run, 0) == pytest.approx(0.7 / 3)


def test_ranks_are_separate_and_pooled():
    run = run_of(
        span("a", "comm", 0, 2, rank=0),
        span("f", "compute", 0, 2, rank=0),
        span("a", "comm", 0, 2, rank=1),
        span("f", "compute", 5, 6, rank=1),
    )
    assert overlap_fraction(run, 0) == 1.0
    assert overlap_fraction(run, 1) == 0.0  # rank 0's compute does not hide rank 1's communication
    assert overlap_fraction(run) == pytest.approx(0.5)


def test_no_communication():
    run = run_of(span("f", "compute", 0, 1))
    assert overlap_fraction(run) == 0.0 and comm_time(run, 0) == 0.0


def test_bytes_per_step_by_phase():
    run = run_of(
        span("broadcast", "comm", -1, -0.5, phase="setup", sent=1000),  # before the first step
        span("forward", "compute", 0, 1, phase="forward"),
        span("all_gather", "comm", 0.5, 0.7, phase="forward", sent=10),
        span("backward", "compute", 1, 2, phase="backward"),
        span("all_reduce", "comm", 1.5, 2.5, phase="backward", sent=100),  # ends after backward: still step 0
        span("optimizer", "compute", 2.5, 3, phase="optimizer"),
        span("all_gather", "comm", 2.9, 3.2, phase="optimizer", sent=7),
        span("forward", "compute", 3.1, 4, phase="forward"),
        span("all_reduce", "comm", 4.5, 5, phase="backward", sent=100),
        span("optimizer", "compute", 5, 6, phase="optimizer"),
        span("all_reduce", "comm", 6.5, 7, phase="idle", sent=999),  # after the last step
    )
    assert step_windows(run, 0) == [(0, 3), (3, 6)]
    assert bytes_per_step(run, 0) == [
        {"forward": 10, "backward": 100, "optimizer": 7, "total": 117},
        {"backward": 100, "total": 100},
    ]
    assert bytes_per_step(run, 1) == []


def test_a_blocking_collective_inside_a_compute_span_hides_nothing():
    # naive data parallelism: backward [0, 4] ends with a synchronous all-reduce [3, 4]
    blocking = dict(span("all_reduce", "comm", 3, 4), args={"bytes_sent": 8, "async_op": False})
    run = run_of(span("backward", "compute", 0, 4), blocking)
    assert overlap_fraction(run) == 0.0
    # the same all-reduce launched asynchronously while backward goes on computing is hidden
    asynchronous = dict(blocking, args={"bytes_sent": 8, "async_op": True})
    assert overlap_fraction(run_of(span("backward", "compute", 0, 4), asynchronous)) == 1.0


def test_computing_subtracts_blocked_time():
    sync = lambda s, e: dict(span("c", "comm", s, e), args={"async_op": False})  # noqa: E731
    run = run_of(
        span("f", "compute", 0, 10),
        span("g", "compute", 12, 14),
        sync(1, 2),
        sync(3, 4),
        sync(9, 13),
        span("w", "wait", 5, 6),
    )
    assert computing(run, 0) == [(0, 1), (2, 3), (4, 5), (6, 9), (13, 14)]
