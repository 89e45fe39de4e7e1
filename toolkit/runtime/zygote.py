"""A process that has imported torch once and forks every launch's keeper, so that no rank imports it again.

Importing torch costs about 2 s of CPU; a rank started as a fresh `python -m toolkit.runtime.worker`
pays it every time, and the ranks, not the work, were most of what a small launch cost. The zygote pays
it once per launcher and environment (`zygotes.py` starts it on the first launch and keeps it). Asked for a
launch, it forks the launch's keeper; the keeper forks the ranks (`keeper.py`: it stays their parent and
subreaper); each rank turns itself back into what a fresh interpreter would be and runs the worker. In order:

1. Start (run by path, `python zygote.py FD`, so `toolkit` itself is never imported here: the grader's
   import hooks, installed in a rank, must see every toolkit module a submission imports). Import torch
   with OMP_NUM_THREADS=1 (more starts an OpenMP worker thread during the import, and a process with a
   second thread is not safe to fork), and never compute: no thread pool, no CUDA, nothing to inherit.
2. Serve: wait on the control socket for a request (the launch's folder, world size, environment and
   working directory; over SCM_RIGHTS its status socket, the ranks' output pipes and the launcher's stdout
   and stderr). Fork the keeper, send back its pid and a pidfd (the launcher signals it without a pid
   race), reap it when it ends and send its exit code. The launcher gone (the socket's end of file):
   exit, and every keeper learns it (PR_SET_PDEATHSIG) and stops its ranks.
3. In a forked keeper and then in each forked rank, `become` what a fresh interpreter would be: the
   launcher's environment replaces ours wholesale, its working directory, sys.path recomputed from them,
   the signal dispositions and mask the launcher had when it asked (exec keeps what is ignored and blocked:
   a rank of a `nohup`'d launcher ignores SIGHUP, whichever process started the zygote), stdout and stderr
   made for the new descriptors, a session of its own, fresh import caches. What fork cannot redo: the
   string hash seed is the zygote's (it is chosen once per interpreter), and /proc/<pid>/environ and cmdline
   show the zygote's start (`zygotes.py` starts a new zygote whenever the launcher's environment differs from
   the one it started in).

Standard library only, besides torch.
"""

from __future__ import annotations

import io
import json
import os
import select
import signal
import socket
import struct
import sys
import threading
import traceback

HEADER = struct.Struct("!I")
_KEEPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "keeper.py")
_START = {}  # where this process started (cwd, sys.path, signals): what a rank's sys.path is recomputed from


# --- messages: a length, then JSON; descriptors ride with the first bytes --------------------------------
def send(sock: socket.socket, message: dict, fds=()) -> None:
    body = json.dumps(message).encode()
    data = HEADER.pack(len(body)) + body
    sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def _exactly(sock: socket.socket, size: int, data: bytes = b"") -> bytes | None:
    while len(data) < size:
        chunk = sock.recv(size - len(data))  # never past this message: the next one may follow at once
        if not chunk:
            return None
        data += chunk
    return data


def receive(sock: socket.socket, max_fds: int = 0) -> tuple[dict | None, list[int]]:
    """(message, descriptors), or (None, []) at the end of the stream."""
    first, fds, _, _ = socket.recv_fds(sock, HEADER.size, max_fds)
    head = _exactly(sock, HEADER.size, first) if first else None
    body = _exactly(sock, HEADER.unpack(head)[0]) if head else None
    if body is None:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(body), fds


# --- a forked child becomes a fresh interpreter ------------------------------------------------------------
def launcher_signals() -> dict:
    """What a fresh interpreter started from this thread now would inherit of its signals (exec resets handlers
    to the default, keeps what is ignored and the blocked mask): asked for by the launcher, sent with a launch."""
    return {
        "ignored": [int(n) for n in signal.valid_signals() if signal.getsignal(n) == signal.SIG_IGN],
        "blocked": sorted(int(n) for n in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    }


def _fresh_signals(inherited: dict) -> None:
    """Dispositions as a new interpreter started by the launcher has them: what the launcher ignored stays
    ignored, the default everywhere else, then Python's own three (SIGINT's handler only where SIGINT is not
    ignored, as CPython's start-up does); the launcher's blocked mask."""
    signal.set_wakeup_fd(-1)
    ignored = set(inherited["ignored"])
    for number in signal.valid_signals():
        want, now = (signal.SIG_IGN if number in ignored else signal.SIG_DFL), signal.getsignal(number)
        if now != want and (now is not None or number in ignored):  # None: not Python's to change (glibc's own)
            signal.signal(number, want)
    if signal.SIGINT not in ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in ("SIGPIPE", "SIGXFSZ"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, inherited["blocked"])


def _stdio(fd: int, name: str):
    """What CPython's start-up makes of descriptor `fd` (pylifecycle.c's create_stdio), for the file it is now."""
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED")) or sys.flags.unbuffered
    buffer = open(fd, "wb", 0 if unbuffered else -1, closefd=False)
    raw = buffer if unbuffered else buffer.raw
    raw.name = name
    old = getattr(sys, name.strip("<>"))
    stream = io.TextIOWrapper(
        buffer,
        old.encoding,
        old.errors,
        newline="\n",
        line_buffering=not unbuffered and (raw.isatty() or fd == 2),
        write_through=unbuffered,
    )
    stream.mode = "w"
    return stream


def become(env: dict, cwd: str | None = None, signals: dict | None = None) -> None:
    """This forked process takes on `env` (wholesale), `cwd` and the launcher's `signals` (`launcher_signals`;
    by default those this zygote started with), and forgets what the zygote had set up."""
    import importlib

    _fresh_signals(signals or _START["signals"])
    main = threading.main_thread()  # fork made this thread the main one, but kept the zygote's thread id as its
    if hasattr(main, "_set_native_id"):  # native_id (CPython gh-132542, fixed in 3.13): /proc/self/task/<it> is gone
        main._set_native_id()
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    here = os.getcwd()
    # sys.path as `python -m` computes it: the working directory first, then PYTHONPATH (relative entries
    # resolved against the working directory), then the interpreter's own (unchanged: same interpreter)
    start_cwd, start_path = _START["cwd"], _START["path"]
    moved = {
        os.path.abspath(os.path.join(start_cwd, p)): os.path.abspath(os.path.join(here, p))
        for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if p and not os.path.isabs(p)
    }
    sys.path[:] = [here] + [moved.get(p, p) for p in start_path[1:]]
    sys.path_importer_cache.clear()
    importlib.invalidate_caches()


def run_worker(folder: str, fd: int, close: list[int]) -> None:
    """In a rank forked by the keeper: stdout and stderr to `fd`, a session of its own, then the worker as
    `python -m toolkit.runtime.worker FOLDER` would run it. Never returns."""
    code = 1
    try:
        os.setsid()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        for other in close:
            os.close(other)
        sys.stdout = sys.__stdout__ = _stdio(1, "<stdout>")
        sys.stderr = sys.__stderr__ = _stdio(2, "<stderr>")
        import faulthandler
        import linecache
        import runpy

        if faulthandler.is_enabled():  # PYTHONFAULTHANDLER: on the new stderr
            faulthandler.enable()
        linecache.clearcache()
        sys.modules.pop("_toolkit_keeper", None)
        sys.argv = ["-m", folder]
        sys.orig_argv = [sys.executable, "-m", "toolkit.runtime.worker", folder]
        runpy.run_module("toolkit.runtime.worker", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if not isinstance(done.code, (int, type(None))):
            print(done.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit code 1
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


# --- the zygote ----------------------------------------------------------------------------------------------
def _keeper(request: dict, writers: list[int], outputs: list[int], zygote: int) -> None:
    """In the forked keeper: the launcher's stdout/stderr, environment and directory, then keeper.main."""
    import importlib.util

    code = 1
    try:
        os.setsid()
        os.dup2(outputs[0], 1)
        os.dup2(outputs[1], 2)
        for fd in outputs:
            os.close(fd)
        become(request["env"], request["cwd"], request["signals"])
        spec = importlib.util.spec_from_file_location("_toolkit_keeper", _KEEPER)
        keeper = importlib.util.module_from_spec(spec)
        sys.modules["_toolkit_keeper"] = keeper
        spec.loader.exec_module(keeper)

        def start_rank(folder: str, rank: int, fd: int, env: dict):
            pid = os.fork()
            if pid == 0:
                become(env, signals=request["signals"])
                run_worker(folder, fd, writers[rank:])  # the keeper closed those of the ranks before
            return keeper.Child(pid)

        keeper.main(request["folder"], request["world_size"], writers, parent=zygote, start=start_rank)
        code = 0
    except BaseException:  # noqa: BLE001 - said on the launcher's stderr; the launcher sees the keeper end
        traceback.print_exc()
    finally:
        os._exit(code)


def _fork_keeper(request: dict, fds: list[int]) -> None:
    """What `serve` forks by default: a launch's keeper (fds: its stdout and stderr, then the ranks' pipes)."""
    _keeper(request, fds[2:], fds[:2], os.getppid())


def serve(control: socket.socket, child=_fork_keeper) -> None:
    """Fork a `child(request, descriptors)` per request (a keeper, unless told otherwise); report each one's pid
    (with a pidfd) and, once reaped, its exit code."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wake-up descriptor is written
    signal.set_wakeup_fd(wake_w)
    running: dict[int, socket.socket] = {}  # keeper pid -> the socket its launch waits on
    while True:
        ready, _, _ = select.select([control, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 512)
            while running:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                told = running.pop(pid, None)
                if told is not None:
                    try:
                        send(told, {"exit": os.waitstatus_to_exitcode(status)})
                    except OSError:  # that launch is no longer listening
                        pass
                    told.close()
        if control in ready:
            request, fds = receive(control, max_fds=256)
            if request is None:  # the launcher is gone (or let us go): its keepers follow (PDEATHSIG)
                return
            status = socket.socket(fileno=fds[0])
            pid = os.fork()
            if pid == 0:
                control.close()
                status.close()
                for sock in running.values():
                    sock.close()
                os.close(wake_r)
                os.close(wake_w)
                child(request, fds[1:])
                os._exit(1)  # a child never returns here
            for fd in fds[1:]:
                os.close(fd)
            pidfd = os.pidfd_open(pid)  # not reaped yet (only this loop reaps): the pid is still this keeper's
            try:
                send(status, {"pid": pid}, [pidfd])
            except OSError:
                pass
            os.close(pidfd)
            running[pid] = status


def say_ready(control: socket.socket) -> None:
    """The hello a launcher checks before it trusts a zygote to fork (`zygote_link.Zygote._refusal`)."""
    send(
        control,
        {
            "ready": True,
            "torch": os.path.abspath(sys.modules["torch"].__file__),
            "threads": len(os.listdir("/proc/self/task")),
        },
    )


def main(fd: int, child=_fork_keeper) -> None:
    """Import torch, say so on the control socket `fd`, then `serve` it (forking `child`s: keepers, unless a
    grading's fork server asks for its own). Never returns."""
    control = socket.socket(fileno=fd)
    os.set_inheritable(fd, False)
    try:
        import torch  # noqa: F401 - imported once here, for every process forked below
    except BaseException as exc:  # noqa: BLE001 - the launcher says why and starts ranks the slow way
        send(control, {"error": f"import torch failed: {type(exc).__name__}: {exc}"})
        os._exit(1)
    _START.update(cwd=os.getcwd(), path=list(sys.path), signals=launcher_signals())
    say_ready(control)
    serve(control, child)
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]))
