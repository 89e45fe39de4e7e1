"""ipyparallel MPI engines with torch.distributed ready, for notebooks that use `%%px` cells.

`toolkit.launch` runs one function on fresh ranks and returns; engines instead stay alive between
cells, so a lesson can build a model in one cell and step it in the next, on every rank at once:

    rc = toolkit.runtime.cluster(4)      # 4 MPI engines, default process group initialized
    %%px
    import torch, toolkit
    x = torch.ones(3); toolkit.comm.all_reduce(x); x
    ...
    toolkit.runtime.stop_cluster(rc)     # or: rc.cluster.stop_cluster_sync()

The engines are started with `mpiexec` (the one beside this Python if there is one, e.g. from the
mpich wheel), so each engine reads its rank from MPI, exactly as under `mpirun` on a cluster.

When a cell fails: the engine that raised aborts its process group, so the others, blocked in a
collective with it, fail within a second instead of waiting out `timeout_s`; the next cell re-creates
the process group on every engine by itself (`cluster_engine.py`). `timeout_s` (30 s by default, short
enough for an interactive cell, long enough for one engine to build a lesson's model while the others
wait) bounds a cell in which a rank skipped a collective; `view.apply` / `apply_sync` / `map_sync`
recover the same way. If an engine exits (`os._exit`), the others live on but cannot run a collective
again; if one is killed by a signal, MPICH's mpiexec ends them all. Either way the toolkit says which
engine died first, how, and how to restart the cluster (`restart_cluster`). In IPython that explanation is
printed under the cell's error; elsewhere, `explain(rc, error)` returns it (`cluster_explain.py`).
"""

from __future__ import annotations

import os
import shutil
import sys
import time

from .cluster_ends import EngineEnds
from .cluster_explain import explain as explain  # cluster.explain, as before (`cluster_explain.py`)
from .cluster_explain import explain_under_errors, guard_targets
from .env import resolve_backend
from .launch import check_seconds

_SETUP = (
    "import toolkit, torch; from toolkit.runtime import cluster_engine as _toolkit_engine; "
    "_toolkit_place = _toolkit_engine.setup({backend!r}, {timeout_s!r})"
)
_START_TIMEOUT_S = 180.0  # engines import torch on start: slow on a loaded laptop


def _mpiexec() -> str:
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = beside if os.path.exists(beside) else shutil.which("mpiexec")
    if found is None:
        raise RuntimeError(
            "no `mpiexec` found: install an MPI (`pip install mpich mpi4py`, or load your "
            "cluster's MPI module) so ipyparallel can start MPI engines."
        )
    return found


def cluster(n: int, *, backend: str = "auto", timeout_s: float = 30.0, activate: bool = True):
    """Start `n` MPI engines, initialize torch.distributed on each, return the connected ipyparallel Client.

    timeout_s: how long a rank waits inside one collective before its cell fails.
    With `activate=True` the `%px`/`%%px` magics target all engines. Stop with `stop_cluster(rc)`.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"cluster needs a positive number of engines, got {n!r}.")
    check_seconds("timeout_s", timeout_s)  # before any engine starts: a bad value must not cost a start-up
    resolve_backend(backend, 1)
    import ipyparallel as ipp

    c = ipp.Cluster(engines="mpi", n=n)
    c.config.MPILauncher.mpi_cmd = [_mpiexec()]
    c.config.MPILauncher.mpi_args = ["-disable-auto-cleanup"]  # one dead engine must not take the others down
    rc = c.start_and_connect_sync(activate=activate and _in_ipython())
    _stamp_calls(rc)
    try:
        rc.wait_for_engines(n, timeout=_START_TIMEOUT_S)
        view = rc[:]
        pids = view.apply_sync(os.getpid)
        rc.toolkit_cluster = {"n": n, "backend": backend, "timeout_s": timeout_s, "activate": activate, "pids": pids}
        view.execute(_SETUP.format(backend=backend, timeout_s=float(timeout_s)), block=True)
        places = view.pull("_toolkit_place", block=True)
    except BaseException:
        stop(rc)  # a start that failed half-way (an engine's set-up raised, engines never came) leaves nothing
        raise
    rc.toolkit_cluster["ranks"] = {e: p.rank for e, p in zip(view.targets, places)}
    rc.toolkit_cluster["ends"] = EngineEnds(dict(zip(view.targets, pids)))
    guard_targets(rc)
    if _in_ipython():
        explain_under_errors(rc)
    return rc


def _stamp_calls(rc) -> None:
    """Give every call one id, the same on each engine it is sent to, later calls larger: the engines tell by it
    which failures came before a call (`cluster_engine`). A view sends a call as one message per engine, all with
    one metadata dict: the id goes into that dict, once."""
    from .cluster_engine import CALL_ID

    last = 0

    def stamped(send):
        def send_stamped(*args, **kwargs):
            nonlocal last
            if kwargs.get("metadata") is None:
                kwargs["metadata"] = {}
            if CALL_ID not in kwargs["metadata"]:
                last = max(last + 1, time.time_ns())  # increasing, and comparable with another client's
                kwargs["metadata"][CALL_ID] = last
            return send(*args, **kwargs)

        return send_stamped

    rc.send_execute_request = stamped(rc.send_execute_request)
    rc.send_apply_request = stamped(rc.send_apply_request)


def _in_ipython() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


def stop(rc) -> None:
    """Stop the engines and controller a `cluster()` call started (engines first: asked, they exit at once)."""
    pids = rc.toolkit_cluster["pids"] if hasattr(rc, "toolkit_cluster") else []
    try:
        rc[:].execute("import os; os._exit(0)", block=False)
    except Exception:  # noqa: BLE001 - no engine left to ask
        pass
    deadline = time.time() + 5
    while any(_alive(pid) for pid in pids) and time.time() < deadline:
        time.sleep(0.05)
    if hasattr(rc, "toolkit_cluster") and "ends" in rc.toolkit_cluster:
        rc.toolkit_cluster["ends"].stop()
    rc.cluster.stop_cluster_sync()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def restart_cluster(rc):
    """Stop the cluster `rc` (dead engines and all) and start a fresh one like it; returns the new Client."""
    options = rc.toolkit_cluster
    try:
        stop(rc)
    except Exception:  # noqa: BLE001 - a half-dead cluster may not stop cleanly; start the new one anyway
        pass
    return cluster(
        options["n"], backend=options["backend"], timeout_s=options["timeout_s"], activate=options["activate"]
    )
