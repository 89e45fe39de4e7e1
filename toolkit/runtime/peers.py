"""Under torchrun, mpiexec or srun: which ranks share this machine, and how those that ended ended.

`toolkit.launch` knows every rank's exit code because it is their parent (through its keeper). Under an
outside launcher a rank's parent is the launcher, so a rank that dies without raising (SIGKILL, `os._exit`,
a script that returned early past a collective) leaves its peers with only "connection closed by peer".
So at `init()` the ranks of each machine tell each other their pids through the process group's store,
and each holds a pidfd of every other (`exits.py`): when a collective fails because a peer went away,
the peer is named with its exit code or signal.

Under mpiexec and srun the launcher kills every rank the moment one dies of a signal, before a survivor
can say anything, so the first rank of each machine also starts a witness (`witness.py`): a small process
in its own session that outlives that cleanup for as long as it takes to name the rank that died first.
A rank that raises leaves a mark first (`mark`): its own traceback is the story, and the deaths
that follow (the launcher ending the job) are not causes.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

from . import exits

_PREFIX = "toolkit/peers"
_WITNESS_START_S = 10.0


class Peers:
    """The other ranks on this machine: {rank: pid} and a pidfd for each."""

    def __init__(self, rank: int, local: dict[int, int], marks: str | None):
        self.rank, self.local, self.marks = rank, local, marks
        self.pidfds = {r: fd for r, pid in local.items() if r != rank and (fd := exits.watch(pid)) is not None}

    def ended(self) -> dict[int, int | None]:
        """{rank: exit code (None: not known)} for the peers on this machine that have ended."""
        return {r: exits.status(fd, self.local[r]) for r, fd in sorted(self.pidfds.items()) if exits.has_ended(fd)}

    def marked(self, kind: str) -> set[int]:
        """The peers that left a `kind` mark ("raised", "consequence", "ended") before ending."""
        try:
            names = os.listdir(self.marks) if self.marks else []
        except OSError:
            return set()
        return {int(n.split("-")[1]) for n in names if n.startswith(f"{kind}-")} - {self.rank}

    def who_went_away(self, patience_s: float = 2.0) -> str:
        """For a rank whose collective failed because a peer went away: which peer, and how it ended. A peer's
        sockets close a moment before its process has ended (its files close first; a script that returned
        then tears down): wait that long."""
        give_up = time.monotonic() + patience_s
        while not (ended := self.ended()) and not self.marked("ended") and time.monotonic() < give_up:
            time.sleep(0.01)
        raised, finished = self.marked("raised"), self.marked("ended")
        told = []
        for r in sorted(set(ended) | finished | raised):
            code = ended.get(r)
            if r in raised:
                told.append(f"rank {r} raised (its traceback is the one to read)")
            elif r in finished or code == 0:
                told.append(
                    f"rank {r} finished its script (it returned, or called sys.exit) while this rank still "
                    f"waited for it in a collective: it returned early, past a collective the others entered"
                )
            elif code is None:
                told.append(f"rank {r} (pid {self.local[r]}) ended; how, this kernel cannot tell")
            else:
                told.append(f"rank {r} (pid {self.local[r]}) {exits.story(code)}")
        return "; ".join(told)


def exchange(store, rank: int, world_size: int, launcher: str) -> Peers | None:
    """Meet the other ranks of this machine through `store`; under mpiexec/srun start this machine's witness.
    Each rank posts its pid under its machine's name, then counts itself in; the last rank in opens the gate.
    (No launcher variable needed for how many ranks share a machine: srun sets one only when asked to.)"""
    if world_size < 2 or not hasattr(os, "pidfd_open"):
        return None
    host = socket.gethostname()
    key = f"{_PREFIX}/{host}"
    index = store.add(f"{key}/n", 1)  # 1 for the first rank of this machine to get here
    store.set(f"{key}/{index}", f"{rank} {os.getpid()}")
    if store.add(f"{_PREFIX}/in", 1) == world_size:
        store.set(f"{_PREFIX}/all-in", "1")
    store.wait([f"{_PREFIX}/all-in"])
    here = store.add(f"{key}/n", 0)
    local = dict(tuple(map(int, store.get(f"{key}/{i}").decode().split())) for i in range(1, here + 1))
    marks = None
    if launcher == "torchrun" and "TORCHELASTIC_ERROR_FILE" in os.environ:  # inside torchrun's own run folder
        marks = os.path.join(os.path.dirname(os.path.dirname(os.environ["TORCHELASTIC_ERROR_FILE"])), "toolkit")
        os.makedirs(marks, exist_ok=True)
    elif launcher in ("openmpi", "mpich", "slurm"):
        if index == 1:
            marks = tempfile.mkdtemp(prefix="toolkit-job-")
            _start_witness(marks, local)
            store.set(f"{key}/marks", marks)
        else:
            marks = store.get(f"{key}/marks").decode()
    global known
    known = Peers(rank, local, marks)
    return known


known: Peers | None = None  # this process's, once `exchange` ran


def _start_witness(marks: str, local: dict[int, int]) -> None:
    """The witness shares this rank's stderr (the launcher forwards it) and lives in its own session, so the
    launcher's cleanup, which kills the ranks' process groups, leaves it the moment it needs."""
    witness = os.path.join(os.path.dirname(os.path.abspath(__file__)), "witness.py")
    pairs = [f"{r}:{pid}" for r, pid in sorted(local.items())]
    subprocess.Popen(
        [sys.executable, witness, marks, socket.gethostname(), *pairs],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        close_fds=True,
    )
    give_up = time.monotonic() + _WITNESS_START_S  # a rank that dies before it watches would go unnamed
    while not os.path.exists(os.path.join(marks, "watching")) and time.monotonic() < give_up:
        time.sleep(0.01)


def mark(peers: Peers | None, rank: int, kind: str) -> None:
    """Before a rank ends: "raised" (its own traceback is the story: the witness must not tell its end, or the
    job's, as a cause), "consequence" (it failed because a peer did) or "ended" (its script finished)."""
    if peers is not None and peers.marks:
        try:
            open(os.path.join(peers.marks, f"{kind}-{rank}"), "w").close()
        except OSError:
            pass
