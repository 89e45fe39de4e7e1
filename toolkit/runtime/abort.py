"""What a failing rank does under an outside launcher (mpiexec, srun, torchrun), so the cause is what one reads.

`install()` (called by `toolkit.runtime.init()`) chains an excepthook after torch's (which prefixes every
line with `[rankN]:`). A rank that raised on its own prints its traceback once. A rank that failed only
because another one did (a lost peer: `blame.is_consequence`) prints one line instead, naming the peer
that went away and how it ended when this machine can tell (`peers.py`). Then, by launcher:

- **mpiexec / srun** wait for every rank, so a rank that raises would leave the others computing (or
  blocked in a collective until the backend's timeout): the hook ends the whole job, `MPI_Abort` under
  mpiexec (via mpi4py), `scancel` of this job step under srun, once the launcher has read what this rank
  wrote (`until_read`: MPI_Abort otherwise overtakes the output still in the pipe, and mpiexec ends the
  job without the traceback it was ended for). A rank that dies without raising is named by this
  machine's witness (`witness.py`).
- **torchrun** stops the other ranks itself once one fails, and ends with a "Root Cause" that names the
  failure with the earliest timestamp, in whole seconds, the lowest rank winning a tie. Consequences
  exit a moment after the cause, usually within its second, so the summary named a consequence. Here
  a consequence rank does not exit: it waits to be stopped by torchrun (a SIGTERM, which torchrun ranks
  after the failure it saw first), and the cause writes torchrun's error file, so the summary shows its
  traceback. A consequence waits at most `TORCHRUN_PATIENCE_S`, and not at all when every peer it saw go
  away ended with exit code 0 (torchrun then has no failure to act on).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import termios
import time
import traceback

from . import peers as peers_

TORCHRUN_PATIENCE_S = 30.0
LAUNCHER_READS_S = 5.0  # how long the launcher gets to read this rank's output before the job is ended


def install(rank: int, launcher: str, peers: peers_.Peers | None = None) -> None:
    """Chain the hook onto whatever excepthook is installed now (torch's, after init)."""
    previous = sys.excepthook

    def on_error(kind, value, tb):
        from .blame import is_consequence

        consequence = is_consequence(value)
        peers_.mark(peers, rank, "consequence" if consequence else "raised")
        if consequence:
            who = peers.who_went_away() if peers is not None else ""
            print(
                f"[rank{rank}]: {kind.__name__} because another rank failed first: "
                f"{who or 'its own error (or the toolkit line naming it) is the one to read'}",
                file=sys.stderr,
            )
        else:
            previous(kind, value, tb)
        if launcher == "torchrun":
            _under_torchrun(rank, kind, value, tb, consequence, peers)
            return
        print(
            f"[rank{rank}]: toolkit: rank {rank} raised {kind.__name__}; ending the whole job "
            f"({how(launcher)}) so the other ranks do not run on.",
            file=sys.stderr,
        )
        _flush()
        abort(launcher)

    sys.excepthook = on_error


def _under_torchrun(rank, kind, value, tb, consequence: bool, peers) -> None:
    if not consequence:
        _record_for_torchrun(kind, value, tb)
        return  # exit as usual, with code 1: torchrun sees this failure first
    ended = peers.ended() if peers is not None else {}
    if ended and all(code == 0 for code in ended.values()):
        return  # nobody failed that torchrun could see: wait for nothing
    print(
        f"[rank{rank}]: toolkit: rank {rank} waits up to {TORCHRUN_PATIENCE_S:g}s for torchrun to stop it, so "
        "that torchrun's summary names the rank that failed first, not this one.",
        file=sys.stderr,
    )
    _flush()
    time.sleep(TORCHRUN_PATIENCE_S)  # torchrun's SIGTERM ends this (Python's default action)
    os._exit(1)


def _record_for_torchrun(kind, value, tb) -> None:
    """What torch's `@record` writes: torchrun's summary then shows this traceback under "Root Cause"."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):  # a @record-decorated main wrote it already
        return
    text = "".join(traceback.format_exception(kind, value, tb))
    try:
        with open(path, "w") as f:
            json.dump(
                {
                    "message": {
                        "message": f"{kind.__name__}: {value}",
                        "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))},
                    }
                },
                f,
            )
    except OSError:
        pass


def _flush() -> None:
    sys.stdout.flush()
    sys.stderr.flush()


def how(launcher: str, environ=None) -> str:
    """Which way the job is ended under this launcher."""
    environ = os.environ if environ is None else environ
    if launcher == "slurm" and "SLURM_STEP_ID" in environ and shutil.which("scancel"):
        return "scancel"
    return "MPI_Abort"


def until_read(fds=(1, 2), patience_s: float = LAUNCHER_READS_S) -> None:
    """Wait until the launcher has read everything this rank wrote to `fds` (pipes to mpiexec's proxy or
    srun's step daemon; anything else is not waited for). MPI_Abort reaches the proxy by another way than
    the output, and MPICH's mpiexec, told to abort, exits without forwarding what it had not read yet:
    measured, a line written and flushed just before MPI_Abort was lost in 24 of 100 jobs at rest (mpiexec
    exited 1 having printed nothing), and in none of 600 with this wait (300 at rest, 300 beside four busy
    loops). A pipe nobody drains does not stop the job ending: after `patience_s` it ends anyway."""
    pipes = [fd for fd in fds if _is_pipe(fd)]
    give_up = time.monotonic() + patience_s
    while any(_unread(fd) for fd in pipes) and time.monotonic() < give_up:
        time.sleep(0.001)


def _is_pipe(fd: int) -> bool:
    try:
        return stat.S_ISFIFO(os.fstat(fd).st_mode)
    except OSError:
        return False


def _unread(fd: int) -> int:
    """Bytes in the pipe behind `fd` that its reader has not read yet (Linux answers FIONREAD for either end)."""
    try:
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
    except OSError:
        return 0


def abort(launcher: str) -> None:
    until_read()
    if how(launcher) == "scancel":  # ends every task of this step, MPI or not
        step = f"{os.environ['SLURM_JOB_ID']}.{os.environ['SLURM_STEP_ID']}"
        subprocess.run(["scancel", "--signal=KILL", step], check=False)
    else:
        try:
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(1)
        except ImportError:
            pass
    os._exit(1)
