"""Nothing of a graded solution outlives its grading: every process it started is found and stopped.

`toolkit.launch` already stops its ranks (each in its own process group) when a launch ends. A
student's code can go further: fork a child that keeps running, start a subprocess in a new session,
daemonize. Such a process escapes its rank's process group, but not its environment: every process
descended from a grading inherits the variable `TOOLKIT_GRADING=<a fresh id>` set for that grading
(unless it goes out of its way to clear its environment). When the grading ends, `Sandbox` kills every
process of this user whose environment carries the id, until none is left.

On Linux the grading process can also become a *child subreaper* (prctl PR_SET_CHILD_SUBREAPER): an
orphan anywhere below it is re-parented to it instead of to init, so even a process that cleared its
environment is found, as a child of ours, and killed. The command line does this; a library call
(`grade()` from a notebook or a test) does not, since it would change how the caller's own orphans
are reaped.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
import uuid

MARKER = "TOOLKIT_GRADING"
PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Orphans below this process are re-parented here (Linux only); True if that worked."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def marked(grading_id: str) -> list[int]:
    """PIDs of live processes whose environment carries this grading's id."""
    needle = f"{MARKER}={grading_id}".encode()
    found = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue  # already dead, waiting to be reaped
        except OSError:
            continue
        found.append(int(name))
    return found


def _parent(pid: int) -> int | None:
    """The parent of process `pid` (from /proc), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _children() -> list[int]:
    """Our own child processes (after PR_SET_CHILD_SUBREAPER: also the orphans re-parented to us)."""
    me = os.getpid()
    return [
        int(name)
        for name in (os.listdir("/proc") if os.path.isdir("/proc") else [])
        if name.isdigit() and _parent(int(name)) == me
    ]


def _reap(pids) -> None:
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


class Sandbox:
    """`with Sandbox() as box:` everything started inside carries `box.id`; on exit none of it survives.

    all_children=True (the command line, a subreaper): also kill every child of this process that
    exists on exit, whatever its environment says; this process started nothing else.
    """

    def __init__(self, all_children: bool = False):
        self.id = os.environ.get(MARKER) or uuid.uuid4().hex  # inside a class run: the class's id for this student
        self.all_children = all_children
        self.killed: list[int] = []

    def __enter__(self) -> Sandbox:
        self._before = os.environ.get(MARKER)
        os.environ[MARKER] = self.id
        return self

    def __exit__(self, *exc) -> None:
        if self._before is None:
            os.environ.pop(MARKER, None)
        else:
            os.environ[MARKER] = self._before
        self.stop_everything()

    def stop_everything(self) -> None:
        self.killed += stop(self.id, self.all_children)


def _namespace(pid) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def namespace_below(pid: int) -> str | None:
    """The PID namespace a child of `pid` lives in, where it is not this process's (a launch's own), else None."""
    ours = _namespace("self")
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if name.isdigit() and _parent(int(name)) == pid and _namespace(name) not in (None, ours):
            return _namespace(name)
    return None


def in_namespace(namespace: str) -> list[int]:
    """The live processes of PID namespace `namespace` (as this process numbers them)."""
    return [
        int(name)
        for name in (os.listdir("/proc") if os.path.isdir("/proc") else [])
        if name.isdigit() and _namespace(name) == namespace
    ]


def ancestors() -> set[int]:
    """This process's parent, its parent's parent, and so on (Linux; empty elsewhere)."""
    found, pid = set(), os.getppid()
    while pid is not None and pid > 1 and pid not in found:
        found.add(pid)
        pid = _parent(pid)
    return found


def stop(grading_id: str | None, all_children: bool = False, rounds: int = 20, spare=()) -> list[int]:
    """SIGKILL every process carrying `grading_id` (and with all_children, every child of ours), again
    and again until none is left (a fork bomb adds processes while we kill), but those in `spare` (the
    grading's fork server, which carries the id for its children's sake). Returns the PIDs killed."""
    killed = []
    for _ in range(rounds):
        pids = [
            p
            for p in (marked(grading_id) if grading_id else []) + (_children() if all_children else [])
            if p not in spare
        ]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)
        _reap(pids)
    return killed
