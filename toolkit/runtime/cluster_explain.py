"""What went wrong in a cell that failed on a cluster's engines, who caused it, and what to do.

`cluster.py` starts the engines; when a `%%px` cell fails, ipyparallel shows each engine's error, and most of them
are consequences (a timeout, a lost partner) of one engine's failure. `explain` names the engine that raised on its
own and calls the others consequences; finds, when no engine raised, the rank that skipped the collective the others
waited in (`cluster_engine.entered`); and, when an engine died, which one died first and how (`cluster_ends.py`),
and whether the others live. In IPython the explanation is printed under the cell's error
(`explain_under_errors`); a call on a view of dead engines says what it means (`guard_targets`).
"""

from __future__ import annotations

import sys

from . import exits

_RESTART = "rc = toolkit.runtime.restart_cluster(rc)"


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


def guard_targets(rc) -> None:
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


def explain_under_errors(rc) -> None:
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
