"""Where the suite's time goes, in CPU seconds as well as wall seconds (TOOLKIT_TEST_TIMES=path.tsv).

On a shared machine wall time says how busy the neighbours were; CPU time says what a test costs. For each
test (setup, call and teardown together) this records the wall time, the CPU time of the pytest process
(every thread) and the CPU time of the processes it started and waited for (ranks, kernels, servers: the
kernel adds a child's time, and that of the children it waited for, when the child is reaped; a process
nobody waits for is not counted). Ranks forked by a zygote are reaped by it, and the zygote outlives the
test: where this process can make a cgroup of its own (Linux, as root: cgroup v1's cpuacct or v2), every
process it starts, however started, is counted there, and `cpu_tree_s` is that count (empty elsewhere).
The file is sorted by CPU, a total line first; pytest's own `--durations=0` gives the wall times alone.

    TOOLKIT_TEST_TIMES=runs/times.tsv .venv/bin/python -m pytest -q
    TOOLKIT_TEST_TIMES=runs/times.tsv .venv/bin/python -m pytest -q -n 2   # runs/times.tsv.gw0 and .gw1
"""

from __future__ import annotations

import atexit
import os
import resource
import time

import pytest

_rows: list[tuple[str, float, float, float, float | None]] = []
# (hierarchy, file, its counter's unit in seconds): cgroup v1's cpuacct, then v2 (unified or alone)
_HIERARCHIES = (
    ("/sys/fs/cgroup/cpuacct", "cpuacct.usage", 1e-9),
    ("/sys/fs/cgroup/unified", "cpu.stat", 1e-6),
    ("/sys/fs/cgroup", "cpu.stat", 1e-6),
)


def _cpu(who) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


class _Tree:
    """A cgroup holding this process and all it starts (made on first use; None where none can be made)."""

    def __init__(self, hierarchy: str, counter: str, unit: float):
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
        v1 = counter == "cpuacct.usage"
        here = next((p for _, names, p in lines if ("cpuacct" in names.split(",") if v1 else names == "")), None)
        if here is None:
            raise OSError("not in this hierarchy")
        self.parent = os.path.join(hierarchy, here.lstrip("/"))
        self.path = os.path.join(self.parent, f"toolkit-tests-{os.getpid()}")
        self.counter, self.unit = os.path.join(self.path, counter), unit
        os.mkdir(self.path)
        try:
            with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
            self.seconds()
        except OSError:
            os.rmdir(self.path)
            raise
        atexit.register(self.remove)  # at exit too, if the session never finished

    def seconds(self) -> float:
        with open(self.counter) as f:
            text = f.read()
        if self.counter.endswith("cpu.stat"):
            text = next(line.split()[1] for line in text.splitlines() if line.startswith("usage_usec "))
        return int(text) * self.unit

    def remove(self) -> None:
        """Every process still in the cgroup (this one, a zygote that ends with it) back to the cgroup this process
        came from, and the cgroup removed. At the session's end: an xdist worker's atexit may never run."""
        try:
            with open(os.path.join(self.path, "cgroup.procs")) as f:
                pids = f.read().split()
            for pid in pids:
                with open(os.path.join(self.parent, "cgroup.procs"), "w") as f:
                    f.write(pid)
        except OSError:
            pass  # a process that ended meanwhile; the rmdir below says whether the cgroup is empty
        give_up = time.monotonic() + 5
        while os.path.isdir(self.path):
            try:
                os.rmdir(self.path)
            except OSError:
                if time.monotonic() > give_up:
                    return
                time.sleep(0.05)


def _make_tree() -> _Tree | None:
    for hierarchy, counter, unit in _HIERARCHIES:
        if os.path.exists(os.path.join(hierarchy, counter)):
            try:
                return _Tree(hierarchy, counter, unit)
            except (OSError, StopIteration, ValueError):
                continue
    return None


_tree: list = []  # [the _Tree or None], once made


def _tree_seconds() -> float | None:
    if not _tree:
        _tree.append(_make_tree())
    return _tree[0].seconds() if _tree[0] else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not os.environ.get("TOOLKIT_TEST_TIMES"):
        yield
        return
    tree = _tree_seconds()
    wall, me, children = time.perf_counter(), _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    yield
    after = _tree_seconds()
    _rows.append(
        (
            item.nodeid,
            time.perf_counter() - wall,
            _cpu(resource.RUSAGE_SELF) - me,
            _cpu(resource.RUSAGE_CHILDREN) - children,
            None if tree is None else after - tree,
        )
    )


def pytest_sessionfinish(session):
    if _tree and _tree[0]:
        _tree[0].remove()
    path = os.environ.get("TOOLKIT_TEST_TIMES")
    if not path or not _rows:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # under xdist each worker writes its own file: path.gw0 ...
    path = f"{path}.{worker}" if worker else path
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    rows = sorted(_rows, key=lambda r: -(r[4] if r[4] is not None else r[2] + r[3]))
    totals = [sum(r[i] for r in rows) for i in (1, 2, 3)]
    tree = "" if rows[0][4] is None else f"{sum(r[4] for r in rows):.2f}"
    with open(path, "w") as f:
        f.write("test\twall_s\tcpu_pytest_s\tcpu_children_s\tcpu_s\tcpu_tree_s\n")
        f.write(
            f"TOTAL ({len(rows)} tests)\t{totals[0]:.2f}\t{totals[1]:.2f}\t{totals[2]:.2f}\t"
            f"{totals[1] + totals[2]:.2f}\t{tree}\n"
        )
        for name, wall, me, children, in_tree in rows:
            in_tree = "" if in_tree is None else f"{in_tree:.2f}"
            f.write(f"{name}\t{wall:.2f}\t{me:.2f}\t{children:.2f}\t{me + children:.2f}\t{in_tree}\n")
