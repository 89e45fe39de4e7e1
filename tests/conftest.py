"""Shared test settings: every multi-process test is bounded in time, and leaves no process behind."""

import atexit
import os
import shutil
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from cpu_times import pytest_runtest_protocol, pytest_sessionfinish  # noqa: E402,F401 - TOOLKIT_TEST_TIMES

os.environ["TOOLKIT_TEST_PID"] = str(os.getpid())  # inherited by every process a test starts, however deep

# Where PYTHONDONTWRITEBYTECODE is set (this machine's shells, some CI images), every rank, kernel and command the
# suite starts compiles the toolkit's modules from source again (a rank imports them after its zygote forks it), and
# each pytest worker rewrites every test module's asserts again (a worker's collection: 13-23 CPU s, 9 with the
# bytecode kept; a rank's toolkit imports: 0.09 CPU s, 0.04). The suite runs as a default Python does instead, its
# bytecode beside the sources (`__pycache__/`, ignored by git and left out of every release). Unset by the process
# that starts the others (xdist's controller, or pytest alone); a grading's sandbox builds its own environment,
# which still writes none.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
    sys.dont_write_bytecode = False

# Under pytest-xdist the workers share the cores out evenly, as `launch` shares them among its ranks: a worker's
# own torch work (references, simulations) and what it starts (notebook kernels, commands) use its share. More
# threads than that only spin against the other worker (5% of a multi-process file's time, measured).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# ipyparallel's controller picks its ~20 ports by binding port 0, releases them, and binds them later: any process
# given a port by the OS meanwhile (a rendezvous store, a rank's connection) can take one, and the cluster never
# starts. The tests' controllers (those of every process they start: the profile is found through IPYTHONDIR) take
# their ports from below the OS's ephemeral range instead, where the OS hands out none.
_CONTROLLER_PORTS = """
import random, socket
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
def _free(port):
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
        return True
get_config().IPController.ports = [p for p in random.sample(range(low // 2, low), 400) if _free(p)][:64]
"""
_IPYTHON_DIR = tempfile.mkdtemp(prefix="toolkit-tests-ipython-")
os.makedirs(os.path.join(_IPYTHON_DIR, "profile_default"))
with open(os.path.join(_IPYTHON_DIR, "profile_default", "ipcontroller_config.py"), "w") as _f:
    _f.write(_CONTROLLER_PORTS)
os.environ["IPYTHONDIR"] = _IPYTHON_DIR
atexit.register(shutil.rmtree, _IPYTHON_DIR, ignore_errors=True)


def _children() -> set[int]:
    """PIDs of live processes started from this test process: a launch's keeper, ranks and what they started
    (in their own sessions, possibly orphaned), known by the environment they inherit (a zygote's, for those
    it forked; the zygotes themselves live as long as this process, by design)."""
    from toolkit.runtime import zygotes

    me, found, ours = os.getpid(), set(), set(zygotes.pids())
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
        launched = b"TOOLKIT_LAUNCH_DIR=" in env or b"TOOLKIT_ZYGOTE=" in env
        if (
            fields[0] != "Z"
            and launched
            and int(pid) not in ours
            and (int(fields[1]) == me or mine in env.split(b"\0"))
        ):
            found.add(int(pid))
    return found


@pytest.fixture
def no_leftover_ranks():
    """Fails the test if a launched rank is still alive after it."""
    yield
    left = _children()
    assert not left, f"ranks left running after the test: {sorted(left)}"
