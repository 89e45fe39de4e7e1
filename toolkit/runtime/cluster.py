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
printed under the cell's error; elsewhere, `explain(rc, error)` returns it.
"""

from __future__ import annotations

import os
import shutil
import sys
import time

from . import exits
from .cluster_ends import EngineEnds
from .env import resolve_backend
from .launch import check_seconds

_SETUP = (
    "import toolkit, torch; from toolkit.runtime import cluster_engine as _toolkit_engine; "
    "_toolkit_place = _toolkit_engine.setup({backend!r}, {timeout_s!r})"
)
_START_TIMEOUT_S = 180.0  # engines import torch on start: slow on a loaded laptop
_RESTART = "rc = toolkit.runtime.restart_cluster(rc)"


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
    _guard_targets(rc)
    if _in_ipython():
        _explain_under_errors(rc)
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


def explain(rc, error) -> str | None:
    """What went wrong in a cell that failed on the engines, who caused it and what to do (None: not ours)."""
    from ipyparallel import error as ipp_error

    from .blame import reads_as_consequence

    ranks = rc.toolkit_cluster["ranks"]
    error = getattr(error, "original_error", error)  # the magic's "already displayed" wrapper
    if isinstance(error, rc.toolkit_cluster.get("gone_error", ())):
        return str(error)  # raised by the toolkit: it says it all
    gone = sorted(set(ranks) - set(rc.ids))
    if isinstance(error, ipp_error.CompositeError):
        failures = [(ei.get("engine_id"), en, str(ev)) for en, ev, _, ei in error.elist]
    elif isinstance(error, ipp_error.RemoteError):
        failures = [(error.engine_info.get("engine_id"), error.ename, error.evalue)]
    elif isinstance(error, ipp_error.KernelError):
        failures = []
    else:
        return None
    gone += sorted({e for e, name, _ in failures if name == "EngineError" and e in ranks} - set(gone))
    if gone or isinstance(error, ipp_error.NoEnginesRegistered):
        return _engines_died(rc, gone)
    causes = [(e, name, text) for e, name, text in failures if not reads_as_consequence(name, text)]
    echoes = [e for e, *_ in failures if e not in {c[0] for c in causes}]
    fresh = "The next cell re-creates the process group on every engine by itself: nothing to restart."
    if not causes:
        story = _who_skipped(rc, failures) or (
            "every error here is a consequence (a timeout or a lost partner): no engine raised on its own, so look "
            "for a rank that skipped the collective, called another one, or is still computing."
        )
        return f"toolkit: {story} {fresh}"
    lines = [
        f"toolkit: rank {ranks.get(e, '?')} (engine {e}) raised {name}: {text.splitlines()[0] if text else ''}"
        for e, name, text in causes
    ]
    if echoes:
        lines.append(
            f"The errors on rank{'s' * (len(echoes) > 1)} {', '.join(str(ranks.get(e, '?')) for e in echoes)} "
            "are consequences: they were waiting for it in a collective when its cell failed."
        )
    return "\n".join(lines + [fresh])


def _guard_targets(rc) -> None:
    """A call on a view of engines that are gone fails inside ipyparallel with `KeyError: 1`; say what it means."""
    from ipyparallel import error as ipp_error

    class EnginesGone(ipp_error.EngineError):
        """The toolkit's explanation, raised where ipyparallel would raise a KeyError for a dead engine."""

    real = rc._build_targets

    def build_targets(targets):
        try:
            return real(targets)
        except (KeyError, IndexError) as exc:
            gone = sorted(set(rc.toolkit_cluster["ranks"]) - set(rc.ids))
            raise EnginesGone(_engines_died(rc, gone)) from exc

    rc._build_targets = build_targets
    rc.toolkit_cluster["gone_error"] = EnginesGone


def _engines_died(rc, gone: list[int]) -> str:
    """Which engine died first and how; whether the others live (MPICH ends them all after a signal)."""
    ranks, ends = rc.toolkit_cluster["ranks"], rc.toolkit_cluster.get("ends")
    ended = ends.first() if ends is not None else [(e, None) for e in gone[:1]]
    alive = ends.alive() if ends is not None else sorted(set(ranks) - set(gone))
    restart = f"Restart the cluster (fresh engines: variables on them are lost):\n    {_RESTART}"
    if not ended:
        return f"toolkit: every engine is gone (none answers). {restart}"

    def how(code):
        return (
            exits.story(code)
            if code is not None
            else (
                "died: its process ended (os._exit, a crash in native code, or it was killed, e.g. by the "
                "out-of-memory killer)"
            )
        )

    if len(ended) == 1:
        first, code = ended[0]
        told = f"toolkit: engine {first} (rank {ranks[first]}) {how(code)}."
    else:  # one of them first, and the others ended by mpiexec at once: nothing tells which
        told = (
            f"toolkit: engines {', '.join(str(e) for e, _ in ended)} (ranks "
            f"{', '.join(str(ranks[e]) for e, _ in ended)}) ended too close together to tell which was first "
            f"(the machine was too busy to see them end one at a time): "
            f"{'; '.join(sorted({how(c) for _, c in ended}))}. One of them ended first."
        )
    if not alive:
        return (
            f"{told} It took the MPI job with it: mpiexec then ended every other engine (MPICH's process "
            f"manager stops all processes of an MPI job when one is killed by a signal), so no engine is "
            f"left. {restart}"
        )
    return (
        f"{told} Engine{'s' * (len(alive) > 1)} {', '.join(map(str, alive))} {'are' if len(alive) > 1 else 'is'} "
        f"alive, but the process group lost a member, so no collective can work again. {restart}"
    )


def _who_skipped(rc, failures) -> str | None:
    """Ask the engines how far each got on the group of the collective that timed out."""
    import re

    from .cluster_engine import entered

    found = next(
        (m for _, _, text in failures if (m := re.search(r"(\w+) #(\d+) \(group \[([\d, ]+)\]\)", text))), None
    )
    if found is None:
        return None
    op, number, group = found[1], int(found[2]), tuple(int(r) for r in found[3].split(","))
    try:
        counts = dict(rc[:].apply_sync(entered, group))  # {rank: collectives entered on the group}
    except Exception:  # noqa: BLE001 - an engine gone: no answer
        return None
    absent = [r for r in group if counts.get(r, 0) < number]
    if not absent:
        return None
    waited = [r for r in group if r not in absent]
    return (
        f"rank{'s' * (len(absent) > 1)} {', '.join(map(str, absent))} did not enter {op} #{number} "
        f"(group {list(group)}): {'they' if len(absent) > 1 else 'it'} finished the cell without calling it, "
        f"while rank{'s' * (len(waited) > 1)} {', '.join(map(str, waited))} waited in it until timeout_s. The "
        "errors shown are those waits (consequences)."
    )


def _explain_under_errors(rc) -> None:
    """In IPython: after ipyparallel shows a cell's engine errors, print the toolkit's explanation."""
    from ipyparallel import error as ipp_error
    from IPython import get_ipython

    def show(shell, kind, value, tb, tb_offset=None):
        shell.showtraceback((kind, value, tb), tb_offset=tb_offset)
        rc = _current["rc"]
        note = None if isinstance(value, rc.toolkit_cluster["gone_error"]) else explain(rc, value)
        if note:
            print(note, file=sys.stderr)

    _current["rc"] = rc
    get_ipython().set_custom_exc((ipp_error.KernelError,), show)


_current: dict = {}
