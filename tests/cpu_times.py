"""Where the suite's time goes, in CPU seconds as well as wall seconds (TOOLKIT_TEST_TIMES=path.tsv).

On a shared machine wall time says how busy the neighbours were; CPU time says what a test costs. For each
test (setup, call and teardown together) this records the wall time, the CPU time of the pytest process
(every thread) and the CPU time of the processes it started and waited for (ranks, kernels, servers: the
kernel adds a child's time, and that of the children it waited for, when the child is reaped; a process
nobody waits for is not counted). The file is sorted by CPU, a total line first; pytest's own
`--durations=0` gives the wall times alone.

    TOOLKIT_TEST_TIMES=runs/times.tsv .venv/bin/python -m pytest -q
    TOOLKIT_TEST_TIMES=runs/times.tsv .venv/bin/python -m pytest -q -n 2   # runs/times.tsv.gw0 and .gw1
"""

from __future__ import annotations

import os
import resource
import time

import pytest

_rows: list[tuple[str, float, float, float]] = []


def _cpu(who) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not os.environ.get("TOOLKIT_TEST_TIMES"):
        yield
        return
    wall, me, children = time.perf_counter(), _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    yield
    _rows.append(
        (
            item.nodeid,
            time.perf_counter() - wall,
            _cpu(resource.RUSAGE_SELF) - me,
            _cpu(resource.RUSAGE_CHILDREN) - children,
        )
    )


def pytest_sessionfinish(session):
    path = os.environ.get("TOOLKIT_TEST_TIMES")
    if not path or not _rows:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # under xdist each worker writes its own file: path.gw0 ...
    path = f"{path}.{worker}" if worker else path
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    rows = sorted(_rows, key=lambda r: -(r[2] + r[3]))
    totals = [sum(r[i] for r in rows) for i in (1, 2, 3)]
    with open(path, "w") as f:
        f.write("test\twall_s\tcpu_pytest_s\tcpu_children_s\tcpu_s\n")
        f.write(
            f"TOTAL ({len(rows)} tests)\t{totals[0]:.2f}\t{totals[1]:.2f}\t{totals[2]:.2f}\t"
            f"{totals[1] + totals[2]:.2f}\n"
        )
        for name, wall, me, children in rows:
            f.write(f"{name}\t{wall:.2f}\t{me:.2f}\t{children:.2f}\t{me + children:.2f}\n")
