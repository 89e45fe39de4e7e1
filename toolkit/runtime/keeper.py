"""The process between `launch` and its ranks: it starts them, timestamps their deaths, and leaves nothing behind.

Why a process of its own, not the launcher (a notebook kernel) itself:

1. **Nothing outlives a launch.** A rank may fork a helper, and the helper may start a new session
   (`setsid`, a daemon's double fork) or outlive the rank. Killing each rank's process group misses both:
   an orphan is re-parented to init and its session is its own. The keeper declares itself a *child
   subreaper* (`prctl(PR_SET_CHILD_SUBREAPER)`, Linux): every orphan below it is re-parented to it instead
   of init, so at teardown every descendant is still in its tree, found by walking `/proc`, and killed.
   A kernel that became a subreaper itself would collect every orphan of everything it ever runs.
2. **A death is dated when it happens, not when it is seen.** The keeper blocks in `waitpid` and writes
   `exit-<rank>` (the exit code, negative for a signal, and the time) the moment a rank ends. The launcher
   may look seconds later on a loaded machine; blame still orders a SIGKILL before a raise 50 ms later.
   (The keeper itself may wait for a CPU after the death wakes it; the kernel counts that wait, and the
   keeper takes it off the time it writes.)

It imports nothing but the standard library: run by path (not as `toolkit.runtime.keeper`, so torch is
never imported: it starts in tens of milliseconds), it starts each rank as a fresh interpreter; forked by
the zygote (`zygote.py`, which loads this file by path too), it forks each rank and `start` makes the rank
a fresh interpreter's equal. Either way it is the ranks' parent and subreaper, and it dies with the
launcher (PR_SET_PDEATHSIG on its parent: the launcher, or the zygote, which ends with the launcher).
Without prctl (not Linux) it still starts, dates and kills the ranks; an orphan that left its rank's
process group may then escape.

The launcher's side, its handle on a keeper, is `keeper_handle.Keeper`.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
PR_SET_PDEATHSIG = 1
KILL_PATIENCE_S = 10.0


# --- the keeper process ------------------------------------------------------------------------------------
class _Stop(Exception):
    """Raised in the keeper's main thread by SIGTERM: the launcher wants everything gone."""


def _become_subreaper() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _descendants(root: int) -> list[int]:
    """Every live process below `root`, parents before children (from each process's parent in /proc)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != b"Z":
            children.setdefault(int(fields[1]), []).append(int(name))
    found, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            found.append(pid)
            todo.append(pid)
    return found


def _run_delay_s() -> float:
    """Seconds this process has spent ready to run but waiting for a CPU (the kernel's schedstat), or 0."""
    try:
        with open("/proc/self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _write(folder: str, name: str, text: str) -> None:
    path = os.path.join(folder, name)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)  # the launcher never reads half a file


class Child:
    """A rank forked in this process (by the zygote's keeper): what `_Ranks` needs of a Popen."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None


def _exec_rank(folder: str, rank: int, fd: int, env: dict) -> subprocess.Popen:
    """A rank as a fresh interpreter: `python -m toolkit.runtime.worker FOLDER`, in a session of its own."""
    return subprocess.Popen(
        [sys.executable, "-m", "toolkit.runtime.worker", folder],
        env=env,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=fd,
        stderr=subprocess.STDOUT,
    )


class _Ranks:
    def __init__(self, folder: str):
        self.folder, self.by_pid = folder, {}

    def spawn(self, world_size: int, fds: list[int], start) -> None:
        """`start(folder, rank, fd, env)` starts rank `rank`, its output to `fd`; it returns the child (its .pid)."""
        for rank in range(world_size):
            p = start(self.folder, rank, fds[rank], dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank)))
            os.close(fds[rank])  # the rank holds its end now; the launcher reads the other
            self.by_pid[p.pid] = (rank, p)
        pids = [p.pid for _, p in sorted(self.by_pid.values(), key=lambda v: v[0])]
        _write(self.folder, "pids.json", json.dumps(pids))

    def reaped(self, pid: int, status: int, when: float) -> None:
        """Note a reaped child: a rank's end is written with its time; an orphan's is just collected."""
        if pid in self.by_pid:
            rank, p = self.by_pid.pop(pid)
            p.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
            _write(self.folder, f"exit-{rank}", json.dumps({"code": p.returncode, "time": when}))

    def reap_all(self, block: bool) -> bool:
        """Collect ended children; False once there is no child at all."""
        while True:
            waited = _run_delay_s()
            try:
                pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
            except ChildProcessError:
                return False
            if pid == 0:
                return True
            # Woken by the death, the keeper may wait for a CPU before it runs again (tens of milliseconds on a
            # loaded machine): that wait, which the kernel counts, is taken off the time it reads.
            self.reaped(pid, status, time.time() - (_run_delay_s() - waited))
            block = False


def _kill_everything(ranks: _Ranks) -> None:
    """SIGKILL every descendant, reap them, and again for whatever was re-parented here meanwhile."""
    give_up = time.monotonic() + KILL_PATIENCE_S
    while time.monotonic() < give_up:
        below = _descendants(os.getpid())
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not ranks.reap_all(block=False) and not below:
            return
        time.sleep(0.005)


def _die_with_parent(parent: int) -> None:
    """If the launcher dies (a kernel restarted), take everything down with it: the kernel sends SIGTERM. (No
    thread polls for it: a second thread holding the GIL when a death wakes the keeper would delay its stamp.)"""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # it died before the request above
        os.kill(os.getpid(), signal.SIGTERM)


def _gone(pid: int) -> bool:
    """True once `pid` has ended (a zombie counts: it ended, nobody has collected it yet; without /proc, True)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except OSError:
        return True


def main(folder: str, world_size: int, fds: list[int], parent: int | None = None, start=_exec_rank) -> None:
    """Start the ranks (`start`: as fresh interpreters, or forked by the zygote's keeper), date their ends,
    and on SIGTERM (the launcher's, or `parent`'s death) kill everything below. `parent`: the process whose
    death means the launcher's (the launcher itself, or the zygote that forked this keeper)."""

    forking, asked = [False], []

    def stop(signum, frame):
        asked.append(signum)
        if not forking[0]:  # raised inside fork's own handlers (logging's, at fork) it would be ignored, and lost
            raise _Stop

    signal.signal(signal.SIGTERM, stop)
    ranks, launcher = _Ranks(folder), int(os.environ.get("TOOLKIT_LAUNCHER_PID", os.getppid()))
    parent = launcher if parent is None else parent
    try:
        subreaper = _become_subreaper()
        _write(folder, "keeper.json", json.dumps({"subreaper": subreaper}))
        _die_with_parent(parent)
        forking[0] = True
        ranks.spawn(world_size, fds, start)
        forking[0] = False
        if asked:  # it came while the ranks were forked
            raise _Stop
        while True:  # date each death as it happens; collect orphans
            if not ranks.reap_all(block=True):
                time.sleep(0.02)  # no child right now (an orphan may still be re-parented here later)
    except _Stop:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        orphaned = os.getppid() != parent
        if orphaned:  # not asked: said first, so that the ranks' deaths read as what they are
            try:
                _write(folder, "orphaned", str(parent))
            except OSError:  # its folder is gone (a launcher that never owned this keeper removed it): kill anyway
                pass
        _kill_everything(ranks)
        if orphaned and _gone(launcher):  # the launcher died: nobody else will remove its folder
            shutil.rmtree(folder, ignore_errors=True)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), [int(fd) for fd in sys.argv[3:]])
