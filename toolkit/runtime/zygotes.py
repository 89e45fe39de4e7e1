"""The launcher's zygotes (`zygote.py`): one per environment, started on the first launch, reused by the next.

A zygote serves only launches from the state it was started in: the same environment (but for what a
launch sets itself, and pytest's PYTEST_CURRENT_TEST), credentials, limits, umask, CPU set, cgroup and
namespaces, the same torch and .pth files, the same zygote.py. Anything else starts a new one (at most
`MAX_ZYGOTES` idle ones are kept), so a forked rank starts where a fresh interpreter would, and a tool that
finds processes by their environment (/proc/<pid>/environ shows a zygote's, the grader's marker among it)
still finds them.

The graders' fork server (`toolkit/grading/forkserver.py`, `server`) is pooled the same way: one per
environment, serving every grading of this process.

Where a zygote cannot serve, `fork_keeper` returns None and the launch starts its keeper and ranks as fresh
interpreters, as before; it says why on stderr, once per reason: not Linux, no fork or pidfd, a zygote that
could not start, more ranks than one message can carry descriptors for. TOOLKIT_LAUNCH_EXEC=1 asks for
the fresh interpreters silently (for debugging). A zygote found dead (killed from outside) is said and
replaced. The zygote ends with its launcher (its control socket's end of file), and `atexit` waits for it.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading

from .interrupts import taken
from .zygote_link import LAUNCH_SETS, ZYGOTE, Forked, Zygote, ZygoteError

MAX_ZYGOTES = 2
# Nothing reads these at start-up, and they change often: pytest's, with every test; the emulated link's
# (toolkit.comm.emulate, between launches), read by a rank's toolkit once forked, from its new environment.
VOLATILE = ("PYTEST_CURRENT_TEST", "TOOLKIT_EMULATED_LINK")
_STATE = (
    "Uid",
    "Gid",
    "Groups",
    "Umask",
    "NoNewPrivs",
    "Seccomp",
    "CapInh",
    "CapPrm",
    "CapEff",
    "CapBnd",
    "CapAmb",
    "Cpus_allowed_list",
    "Mems_allowed_list",
)
_MAX_FDS = 253  # SCM_MAX_FD: descriptors one message can carry (the ranks' pipes, a status socket, stdout, stderr)


_pool: dict[str, Zygote] = {}  # by key; the most recently used last
_adopted: Zygote | None = None  # the zygote this process was forked by, serving every launch (`adopt`)
_broken: dict[str, str] = {}  # key -> why its zygote could not start (not tried again)
_said: set[str] = set()
_lock = threading.Lock()


def _say(why: str, once: bool = True) -> None:
    if not (once and why in _said):
        _said.add(why)
        print(f"toolkit.launch: {why}", file=sys.stderr, flush=True)


def why_not(world_size: int) -> str | None:
    """Why no zygote can serve this launch ("" to say nothing), or None."""
    if os.environ.get("TOOLKIT_LAUNCH_EXEC") == "1":
        return ""
    if not sys.platform.startswith("linux"):
        return f"ranks start as fresh interpreters here (the zygote that forks them needs Linux, not {sys.platform})"
    if not all(
        hasattr(m, n)
        for m, n in ((os, "fork"), (os, "pidfd_open"), (socket, "send_fds"), (signal, "pidfd_send_signal"))
    ):
        return "ranks start as fresh interpreters here (the zygote needs os.fork, pidfds and SCM_RIGHTS)"
    if world_size + 3 > _MAX_FDS:
        return (
            f"{world_size} ranks start as fresh interpreters (one message to the zygote carries at most "
            f"{_MAX_FDS - 3} ranks' output pipes)"
        )
    return None


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _stat(path: str | None) -> tuple:
    try:
        s = os.stat(path)
        return path, s.st_mtime_ns, s.st_size
    except (OSError, TypeError):
        return path, None


def key(env: dict) -> str:
    """What a zygote must share with a launch to serve it (see the module's docstring), as one hash."""
    import site

    status = [line for line in _read("/proc/self/status").splitlines() if line.split(":")[0] in _STATE]
    spaces = [
        os.readlink(f"/proc/self/ns/{n}") if os.path.exists(f"/proc/self/ns/{n}") else n
        for n in ("mnt", "net", "pid_for_children", "user", "uts", "ipc", "cgroup")
    ]
    sites = [*site.getsitepackages(), site.getusersitepackages()]
    pth = [
        (d, sorted(_stat(os.path.join(d, e)) for e in os.listdir(d) if e.endswith(".pth")))
        for d in sites
        if os.path.isdir(d)
    ]
    torch = getattr(sys.modules.get("torch"), "__file__", None)
    parts = (
        sorted((k, v) for k, v in env.items() if k not in LAUNCH_SETS + VOLATILE),
        status,
        spaces,
        _read("/proc/self/limits"),
        _read("/proc/self/cgroup"),
        pth,
        _stat(torch),
        _stat(ZYGOTE),
        sys.executable,
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _zygote_for(k: str, env: dict, script: str = ZYGOTE) -> Zygote:
    with _lock:
        zygote = _pool.get(k)  # left in the pool until it is known dead (an interrupt may land anywhere below)
        if zygote is not None and zygote.process.poll() is not None:
            _say(
                f"the zygote that forks ranks (pid {zygote.process.pid}) had ended ({zygote._how()}): starting a "
                "new one",
                once=False,
            )
            _pool.pop(k).close()
            zygote = None
        if zygote is None:
            if k in _broken:
                raise ZygoteError(_broken[k])
            idle = [kk for kk, z in _pool.items() if z.idle()]
            for kk in idle[: len(_pool) + 1 - MAX_ZYGOTES]:  # the least recently used first
                _pool.pop(kk).close()
            try:
                zygote = Zygote(env, script=script)
            except (ZygoteError, OSError) as exc:
                _broken[k] = str(exc)
                raise ZygoteError(str(exc)) from exc
        _pool.pop(k, None)
        _pool[k] = zygote  # the most recently used last
        return zygote


def server(env: dict, script: str) -> Zygote:
    """A zygote running `script` (a grading's `forkserver.py`) for `env`, pooled as the ranks' zygotes are:
    started on first use, shared by every later caller with the same environment and state."""
    return _zygote_for(key(env) + script, env, script)


def _ended(zygote: Zygote) -> bool:
    """True if `zygote` died (its socket ended: it is exiting, if not gone yet)."""
    try:
        zygote.process.wait(timeout=5)
        return True
    except subprocess.TimeoutExpired:
        return False


def adopt(control: socket.socket, pid: int) -> None:
    """From now on every launch of this process asks the zygote `pid` that forked it (on `control`), whatever
    the environment: a grading's launcher, forked inside the sandbox by `toolkit/grading/forkserver.py`."""
    global _adopted
    _adopted = Zygote.adopt(control, pid)


def fork_keeper(folder: str, world_size: int, env: dict, writers: list[int]) -> Forked | None:
    """The launch's keeper, forked by the zygote for `env` (started first if need be), or None: start it as a
    fresh interpreter (the reason is said on stderr, once)."""
    why = why_not(world_size)
    if why is None and _adopted is not None:
        try:
            return _adopted.fork_keeper(folder, world_size, env, writers)
        except ZygoteError as exc:
            why = f"ranks start as fresh interpreters (the zygote that forked this launcher failed: {exc})"
    elif why is None:
        k = key(env)
        for attempt in range(2):  # a zygote killed since it last served: once more, with a new one
            try:
                with taken():  # a Ctrl-C while a zygote imports torch acts at once: nothing of the launch runs yet
                    zygote = _zygote_for(k, env)
                return zygote.fork_keeper(folder, world_size, env, writers)
            except ZygoteError as exc:
                why = f"ranks start as fresh interpreters (the zygote that forks them failed: {exc})"
                if attempt or k in _broken or not _ended(zygote):
                    break
    if why:
        _say(why)
    return None


def pids() -> list[int]:
    """The live zygotes of this process (tests tell them from leftover ranks)."""
    return [z.process.pid for z in list(_pool.values()) if z.process.poll() is None]


def close_all() -> None:
    global _adopted
    if _adopted is not None:
        _adopted.close()
        _adopted = None
    with _lock:
        while _pool:
            _pool.popitem()[1].close()


def _forget_after_fork() -> None:
    """In a child forked from the launcher: its zygotes are the parent's, not this process's to use or close."""
    global _lock, _adopted
    _lock = threading.Lock()
    if _adopted is not None:
        _adopted.control.close()
        _adopted = None
    for zygote in _pool.values():
        zygote.control.close()
        zygote.process.returncode = 0  # not ours to wait for
    _pool.clear()


atexit.register(close_all)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
