"""The process that starts one grading's ranks (`session.LAUNCHER`, a fresh interpreter, where no fork server serves).

Forked by the grading's fork server (`forkserver.py`), inside the launch's sandbox already, which forks
its ranks too; or, where no fork server can serve, started by the grader (`session.py`) in a session of its
own, inside the grading's folder: it then enters the sandbox itself (`sandbox.enter`: namespaces, limits,
`nobody` when started as root, landlock), before anything else. Either way it launches the ranks
(`toolkit.launch`, each running `runner.rank_main`). It runs no student code, but it reads what the ranks leave
for `launch` (their errors), so it is inside the sandbox too, and nothing it could be made to do decides a
limit (the grader's overseer watches time, output and processes). What it writes (launch.json: how the launch
ended) is read by the grader as untrusted text. It ends with the grader: a grader killed from outside leaves
nothing running.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import tempfile

from .runner import _write, rank_main


def _die_with_the_grader() -> None:
    """If the grader is killed, this process goes too (and with it, through the keeper, every rank)."""
    if sys.platform.startswith("linux"):
        parent = os.getppid()
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # it died before the line above
            os._exit(1)


def main(argv=None, spec=None, zygote=None) -> int:
    """Start the ranks of one grading (see the module docstring); how it ended goes to launch.json.
    Forked by a grading's sandbox zygote (`forkserver.py`): `spec` as it read it before entering the sandbox,
    `zygote` its (control socket, pid), to fork the ranks. Else a fresh interpreter: the spec's path in argv."""
    from ..runtime import zygotes
    from ..runtime.launch import RankError, launch
    from . import sandbox

    _die_with_the_grader()
    if zygote is None:
        with open((argv or sys.argv[1:])[0]) as f:
            spec = json.load(f)
        sandbox.enter(spec)  # may fork: this is then the launch's PID namespace's first process
    else:
        zygotes.adopt(*zygote)
    limits, error = spec["limits"], None
    # the launch's own folder (the ranks' exits and errors, `toolkit.launch`'s) lies with what the ranks send back,
    # apart from what the submission writes: a submission that fills its folders still has its failure told
    tempfile.tempdir = spec["out"]
    try:
        launch(
            rank_main,
            spec["world_size"],
            args=(spec,),
            backend=spec["backend"],
            timeout_s=limits["check_timeout_s"] + 5,
            deadline_s=(len(spec["indices"]) + 1) * (limits["time_limit_s"] + 5) + 60,
        )
    except RankError as exc:
        error = {"message": str(exc), "rank": exc.rank}
    except Exception as exc:  # noqa: BLE001 - say what ended the launch; the grader decides what it means
        error = {"message": f"{type(exc).__name__}: {exc}", "rank": None}
    _write(os.path.join(spec["out"], "launch.json"), json.dumps({"error": error}).encode())
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
