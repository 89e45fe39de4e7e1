"""Which cluster engine ended first, and how, seen from the notebook (for `cluster_explain.explain`).

When one engine is killed by a signal (the out-of-memory killer, `kill -9`), MPICH's process manager ends
every other engine of the MPI job at once (it sends SIGUSR1, then SIGKILL), `-disable-auto-cleanup` or
not; an engine that exits with a code (`os._exit`) leaves the others running. Afterwards every engine
reads "dead", so the order is kept as it happens: a thread in the notebook holds a pidfd of each engine
(`exits.py`) and notes each end, with its exit code, in the order seen. Ends it sees at one wake-up have no
order it could tell (on a busy machine mpiexec ends the others before the thread runs): `first()` says so.
"""

from __future__ import annotations

import os
import select
import threading

from . import exits


class EngineEnds:
    """{engine id: pid} watched from a daemon thread; `ended()` lists the ends in the order they happened."""

    def __init__(self, pids: dict[int, int]):
        self.pids, self.seen = pids, []  # [(engine, exit code or None, the wake-up it was seen at)]
        self._fds = {fd: e for e, pid in pids.items() if (fd := exits.watch(pid)) is not None}
        self._wake, self._woken = os.pipe()
        threading.Thread(target=self._watch, daemon=True, name="toolkit-engine-ends").start()

    def _watch(self) -> None:
        wake_up = 0
        while self._fds:
            ready, _, _ = select.select([*self._fds, self._wake], [], [])
            if self._wake in ready:
                break
            for fd in sorted(ready, key=self._fds.get):  # seen together: no order to tell, engine id order
                engine = self._fds.pop(fd)
                self.seen.append((engine, exits.status(fd, self.pids[engine]), wake_up))
                os.close(fd)
            wake_up += 1
        for fd in self._fds:
            os.close(fd)
        os.close(self._wake)

    def ended(self) -> list[tuple[int, int | None]]:
        return [(engine, code) for engine, code, _ in self.seen]

    def first(self) -> list[tuple[int, int | None]]:
        """The first ends seen: one engine, or several that ended too close together to tell which was first."""
        return [(engine, code) for engine, code, wake_up in self.seen if wake_up == self.seen[0][2]]

    def alive(self) -> list[int]:
        gone = {e for e, _, _ in self.seen}
        return [e for e in sorted(self.pids) if e not in gone and _running(self.pids[e])]

    def stop(self) -> None:
        try:
            os.write(self._woken, b"x")
            os.close(self._woken)
        except OSError:
            pass


def _running(pid: int) -> bool:
    if not os.path.isdir("/proc"):
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
