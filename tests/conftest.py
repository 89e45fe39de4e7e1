"""Shared test settings: every multi-process test is bounded in time, and leaves no process behind."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from cpu_times import pytest_runtest_protocol, pytest_sessionfinish  # noqa: E402,F401 - TOOLKIT_TEST_TIMES


os.environ["TOOLKIT_TEST_PID"] = str(os.getpid())  # inherited by every process a test starts, however deep


def _children() -> set[int]:
    """PIDs of live processes started from this test process: a launch's keeper, ranks and what they started
    (in their own sessions, possibly orphaned), known by the environment they inherit."""
    me, found = os.getpid(), set()
    mine = f"TOOLKIT_TEST_PID={me}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if fields[0] != "Z" and b"TOOLKIT_LAUNCH_DIR=" in env and (int(fields[1]) == me or mine in env.split(b"\0")):
            found.add(int(pid))
    return found


@pytest.fixture
def no_leftover_ranks():
    """Fails the test if a launched rank is still alive after it."""
    yield
    left = _children()
    assert not left, f"ranks left running after the test: {sorted(left)}"
