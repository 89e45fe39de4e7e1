"""The launcher's zygotes (`zygote.py`): one per environment, started on the first launch, reused by the next.

A zygote serves only launches from the state it was started in: the same environment (but for what a
launch sets itself, and pytest's PYTEST_CURRENT_TEST), credentials, limits, umask, CPU set, cgroup and
namespaces, the same torch and .pth files, the same zygote.py. Anything else starts a new one (at most
`MAX_ZYGOTES` idle ones are kept), so a forked rank starts where a fresh interpreter would, and a tool that
finds processes by their environment (/proc/<pid>/environ shows a zygote's, the grader's marker among it)
still finds them.

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
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from . import exits
from .zygote import receive, send

ZYGOTE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote.py")
MAX_ZYGOTES = 2
START_PATIENCE_S = 180.0  # a zygote imports torch: slow on a loaded machine, never minutes
LAUNCH_SETS = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "TOOLKIT_STORE_PORT", "TOOLKIT_LAUNCH_DIR", "TOOLKIT_LAUNCHER_PID",
               "OMP_NUM_THREADS")
# Nothing reads these at start-up, and they change often: pytest's, with every test; the emulated link's
# (toolkit.comm.emulate, between launches), read by a rank's toolkit once forked, from its new environment.
VOLATILE = ("PYTEST_CURRENT_TEST", "TOOLKIT_EMULATED_LINK")
_STATE = ("Uid", "Gid", "Groups", "Umask", "NoNewPrivs", "Seccomp", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb",
          "Cpus_allowed_list", "Mems_allowed_list")
_MAX_FDS = 253  # SCM_MAX_FD: descriptors one message can carry (the ranks' pipes, a status socket, stdout, stderr)


class ZygoteError(RuntimeError):
    """A zygote could not start, or could not fork a keeper: the launch starts fresh interpreters instead."""


class Forked:
    """The launcher's handle on a keeper the zygote forked: Popen's poll, wait, send_signal and kill, without
    being its parent (its pid through a pidfd, its exit code from the zygote that reaps it)."""

    def __init__(self, pid: int, pidfd: int, status: socket.socket):
        self.pid, self.pidfd, self.status, self.returncode = pid, pidfd, status, None

    def poll(self) -> int | None:
        if self.returncode is None and self.status is not None and select.select([self.status], [], [], 0)[0]:
            told, _ = receive(self.status)
            self.status.close()
            self.status = None
            if told is not None:
                self._ended(told["exit"])
        if self.returncode is None and self.status is None and exits.has_ended(self.pidfd):
            code = exits.status(self.pidfd, self.pid)  # its zygote died first: nobody told us
            self._ended(1 if code is None else code)
        return self.returncode

    def _ended(self, code: int) -> None:
        self.returncode = code
        os.close(self.pidfd)
        if self.status is not None:
            self.status.close()
            self.status = None

    def wait(self, timeout: float | None = None) -> int:
        give_up = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 0.05 if give_up is None else min(0.05, give_up - time.monotonic())
            if left <= 0:
                raise subprocess.TimeoutExpired("keeper", timeout)
            select.select([self.status if self.status is not None else self.pidfd], [], [], left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                signal.pidfd_send_signal(self.pidfd, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    def __init__(self, env: dict):
        ours, theirs = socket.socketpair()
        env = {k: v for k, v in env.items() if k not in LAUNCH_SETS}
        try:
            self.process = subprocess.Popen(
                [sys.executable, ZYGOTE, str(theirs.fileno())], pass_fds=[theirs.fileno()], start_new_session=True,
                env=dict(env, OMP_NUM_THREADS="1", TOOLKIT_ZYGOTE="1"), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.control, self.lock, self.keepers = ours, threading.Lock(), []
        give_up = time.monotonic() + START_PATIENCE_S
        while not select.select([ours], [], [], 0.1)[0]:
            if time.monotonic() > give_up:
                self.close()
                raise ZygoteError(f"it had not imported torch after {START_PATIENCE_S:.0f} s")
        hello, _ = receive(ours)
        if hello is None or "error" in hello:
            self.close()
            raise ZygoteError(hello["error"] if hello else f"it ended while starting ({self._how()})")
        if hello["threads"] != 1:  # forking a process with a second thread can deadlock the child
            self.close()
            raise ZygoteError(f"importing torch left {hello['threads']} threads in it (fork is safe with one)")
        mine = os.path.abspath(getattr(sys.modules.get("torch"), "__file__", "") or "")
        if hello["torch"] != mine:
            self.close()
            raise ZygoteError(f"it imported torch from {hello['torch']}, this process from {mine}")

    def _how(self) -> str:
        code = self.process.poll()
        return "still running" if code is None else (
            f"killed by {exits.signal_name(-code)}" if code < 0 else f"exit code {code}")

    def fork_keeper(self, folder: str, world_size: int, env: dict, writers: list[int]) -> Forked:
        try:
            cwd = os.getcwd()
        except OSError as exc:
            raise ZygoteError(f"the working directory is gone ({exc})") from exc
        status, theirs = socket.socketpair()
        try:
            with self.lock:
                send(self.control, {"folder": folder, "world_size": world_size, "env": env, "cwd": cwd},
                     [theirs.fileno(), 1, 2, *writers])  # the keeper's stdout and stderr are ours
            theirs.close()
            reply, fds = receive(status, max_fds=1)
        except OSError as exc:
            status.close()
            raise ZygoteError(f"it could not be reached ({exc})") from exc
        finally:
            theirs.close()
        if reply is None:
            status.close()
            raise ZygoteError(f"it ended before forking the keeper ({self._how()})")
        keeper = Forked(reply["pid"], fds[0], status)
        self.keepers = [k for k in self.keepers if k.returncode is None] + [keeper]
        return keeper

    def idle(self) -> bool:
        return all(k.poll() is not None for k in self.keepers)

    def close(self) -> None:
        """Let it go (the end of its socket ends it) and collect it."""
        self.control.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_pool: dict[str, Zygote] = {}  # by key; the most recently used last
_broken: dict[str, str] = {}   # key -> why its zygote could not start (not tried again)
_said: set[str] = set()
_lock = threading.Lock()


def _say(why: str, once: bool = True) -> None:
    if not (once and why in _said):
        _said.add(why)
        print(f"toolkit.launch: {why}", file=sys.stderr, flush=True)


def _cannot(world_size: int) -> str | None:
    """Why no zygote can serve this launch ("" to say nothing), or None."""
    if os.environ.get("TOOLKIT_LAUNCH_EXEC") == "1":
        return ""
    if not sys.platform.startswith("linux"):
        return f"ranks start as fresh interpreters here (the zygote that forks them needs Linux, not {sys.platform})"
    if not all(hasattr(m, n) for m, n in ((os, "fork"), (os, "pidfd_open"), (socket, "send_fds"),
                                          (signal, "pidfd_send_signal"))):
        return "ranks start as fresh interpreters here (the zygote needs os.fork, pidfds and SCM_RIGHTS)"
    if world_size + 3 > _MAX_FDS:
        return (f"{world_size} ranks start as fresh interpreters (one message to the zygote carries at most "
                f"{_MAX_FDS - 3} ranks' output pipes)")
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
    spaces = [os.readlink(f"/proc/self/ns/{n}") if os.path.exists(f"/proc/self/ns/{n}") else n
              for n in ("mnt", "net", "pid_for_children", "user", "uts", "ipc", "cgroup")]
    sites = [*site.getsitepackages(), site.getusersitepackages()]
    pth = [(d, sorted(_stat(os.path.join(d, e)) for e in os.listdir(d) if e.endswith(".pth")))
           for d in sites if os.path.isdir(d)]
    torch = getattr(sys.modules.get("torch"), "__file__", None)
    parts = (sorted((k, v) for k, v in env.items() if k not in LAUNCH_SETS + VOLATILE), status, spaces,
             _read("/proc/self/limits"), _read("/proc/self/cgroup"), pth, _stat(torch), _stat(ZYGOTE), sys.executable)
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _zygote_for(k: str, env: dict) -> Zygote:
    with _lock:
        zygote = _pool.pop(k, None)
        if zygote is not None and zygote.process.poll() is not None:
            _say(f"the zygote that forks ranks (pid {zygote.process.pid}) had ended ({zygote._how()}): starting a "
                 "new one", once=False)
            zygote.close()
            zygote = None
        if zygote is None:
            if k in _broken:
                raise ZygoteError(_broken[k])
            idle = [kk for kk, z in _pool.items() if z.idle()]
            for kk in idle[:len(_pool) + 1 - MAX_ZYGOTES]:  # the least recently used first
                _pool.pop(kk).close()
            try:
                zygote = Zygote(env)
            except (ZygoteError, OSError) as exc:
                _broken[k] = str(exc)
                raise ZygoteError(str(exc)) from exc
        _pool[k] = zygote
        return zygote


def _ended(zygote: Zygote) -> bool:
    """True if `zygote` died (its socket ended: it is exiting, if not gone yet)."""
    try:
        zygote.process.wait(timeout=5)
        return True
    except subprocess.TimeoutExpired:
        return False


def fork_keeper(folder: str, world_size: int, env: dict, writers: list[int]) -> Forked | None:
    """The launch's keeper, forked by the zygote for `env` (started first if need be), or None: start it as a
    fresh interpreter (the reason is said on stderr, once)."""
    why = _cannot(world_size)
    if why is None:
        k = key(env)
        for attempt in range(2):  # a zygote killed since it last served: once more, with a new one
            try:
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
    with _lock:
        while _pool:
            _pool.popitem()[1].close()


def _forget_after_fork() -> None:
    """In a child forked from the launcher: its zygotes are the parent's, not this process's to use or close."""
    global _lock
    _lock = threading.Lock()
    for zygote in _pool.values():
        zygote.control.close()
        zygote.process.returncode = 0  # not ours to wait for
    _pool.clear()


atexit.register(close_all)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
