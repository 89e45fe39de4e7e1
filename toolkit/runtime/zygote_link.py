"""The launcher's end of one zygote (`zygote.py`): start it, ask it for a keeper, and hold that keeper.

`Zygote(env)` starts one and waits until it has imported torch (and checks that it is safe to fork: one
thread, the same torch as this process). `fork_keeper` sends it a launch and returns a `Forked`: the
launcher's handle on the keeper, with what `Keeper` uses of a Popen, though the launcher is not its parent.
Which zygote serves which launch, and when none does, is `zygotes.py`'s business.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from . import exits
from .fresh_interpreter import launcher_signals
from .interrupts import held, taken
from .zygote import receive, send

ZYGOTE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote.py")
START_PATIENCE_S = 180.0  # a zygote imports torch: slow on a loaded machine, never minutes
# set by each launch for itself: not the zygote's (nor what tells one zygote from another)
LAUNCH_SETS = (
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "TOOLKIT_STORE_PORT",
    "TOOLKIT_LAUNCH_DIR",
    "TOOLKIT_LAUNCHER_PID",
    "OMP_NUM_THREADS",
)


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
    adopted = False  # True: a zygote this process was forked by (`adopt`), not one it started

    @classmethod
    def adopt(cls, control: socket.socket, pid: int) -> Zygote:
        """The zygote (pid) that forked this process and serves it on `control`: a grading's sandboxed one."""
        zygote = cls.__new__(cls)
        zygote.process = Forked(pid, os.pidfd_open(pid), None)
        zygote.control, zygote.lock, zygote.keepers, zygote.adopted = control, threading.Lock(), [], True
        return zygote

    def __init__(self, env: dict, script: str = ZYGOTE):
        ours, theirs = socket.socketpair()
        env = {k: v for k, v in env.items() if k not in LAUNCH_SETS}
        self.control, self.lock, self.keepers = ours, threading.Lock(), []
        with held():  # a Ctrl-C waits until the zygote is `self.process`, then acts in `_greeted`, which ends it
            try:
                self.process = subprocess.Popen(
                    [sys.executable, script, str(theirs.fileno())],
                    pass_fds=[theirs.fileno()],
                    start_new_session=True,
                    env=dict(env, OMP_NUM_THREADS="1", TOOLKIT_ZYGOTE="1"),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                )
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
            self._greeted()

    @classmethod
    def forked_by(cls, parent: Zygote, request: dict) -> Zygote:
        """A zygote that `parent` forks for `request` rather than a new interpreter (a grading's fork server,
        forked by the server every grading of this process shares): it has torch already."""
        ours, theirs = socket.socketpair()
        with held():  # as in `__init__`
            try:
                process = parent.fork(request, [theirs.fileno()])
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
            zygote = cls.__new__(cls)
            zygote.process, zygote.control, zygote.lock, zygote.keepers = process, ours, threading.Lock(), []
            zygote._greeted()
        return zygote

    def _greeted(self) -> None:
        """Wait for its hello; close it and raise ZygoteError if it cannot serve."""
        give_up = time.monotonic() + START_PATIENCE_S
        try:
            with taken():  # it imports torch (seconds): a Ctrl-C acts at once, and nothing is left of it
                while not select.select([self.control], [], [], 0.1)[0] and time.monotonic() < give_up:
                    pass
                hello = receive(self.control)[0] if select.select([self.control], [], [], 0)[0] else None
        except BaseException:
            self.process.kill()
            self.process.wait()
            self.control.close()
            raise
        why = self._refusal(hello)
        if why:
            self.close()
            raise ZygoteError(why)

    def _refusal(self, hello: dict | None) -> str | None:
        """Why the zygote that said `hello` cannot serve (None: it can)."""
        mine = os.path.abspath(getattr(sys.modules.get("torch"), "__file__", "") or "")
        if hello is None:
            return (
                f"it ended while starting ({self._how()})"
                if self.process.poll() is not None
                else f"it had not imported torch after {START_PATIENCE_S:.0f} s"
            )
        if "error" in hello:
            return hello["error"]
        if hello["threads"] != 1:  # forking a process with a second thread can deadlock the child
            return f"importing torch left {hello['threads']} threads in it (fork is safe with one)"
        if hello["torch"] != mine:
            return f"it imported torch from {hello['torch']}, this process from {mine}"
        return None

    def _how(self) -> str:
        code = self.process.poll()
        return (
            "still running"
            if code is None
            else (f"killed by {exits.signal_name(-code)}" if code < 0 else f"exit code {code}")
        )

    def fork_keeper(self, folder: str, world_size: int, env: dict, writers: list[int]) -> Forked:
        try:
            cwd = os.getcwd()
        except OSError as exc:
            raise ZygoteError(f"the working directory is gone ({exc})") from exc
        # the keeper's stdout and stderr are ours; its signals, as a process we started now would have them
        return self.fork(
            {"folder": folder, "world_size": world_size, "env": env, "cwd": cwd, "signals": launcher_signals()},
            [1, 2, *writers],
        )

    def fork(self, request: dict, fds: list[int]) -> Forked:
        """Ask the zygote to fork a child for `request`, handing it the descriptors `fds`: a handle on it."""
        status, theirs = socket.socketpair()
        try:
            with self.lock:
                send(self.control, request, [theirs.fileno(), *fds])
            theirs.close()
            reply, fds = receive(status, max_fds=1)
        except OSError as exc:
            status.close()
            raise ZygoteError(f"it could not be reached ({exc})") from exc
        finally:
            theirs.close()
        if reply is None:
            status.close()
            raise ZygoteError(f"it ended before forking ({self._how()})")
        keeper = Forked(reply["pid"], fds[0], status)
        self.keepers = [k for k in self.keepers if k.returncode is None] + [keeper]
        return keeper

    def idle(self) -> bool:
        return all(k.poll() is not None for k in self.keepers)

    def close(self) -> None:
        """Let it go (the end of its socket ends it) and collect it (one we were forked by collects us)."""
        self.control.close()
        if self.adopted:
            return
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
