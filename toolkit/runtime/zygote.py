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
3. In a forked keeper and then in each forked rank, `become` what a fresh interpreter would be
   (`fresh_interpreter.py`: the launcher's environment, working directory, sys.path and signals).

Standard library only, besides torch.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import struct
import sys
import traceback

HEADER = struct.Struct("!I")
_HERE = os.path.dirname(os.path.abspath(__file__))
_KEEPER = os.path.join(_HERE, "keeper.py")
# torch's own modules that a rank imports as soon as it uses DTensor or a DeviceMesh's plans (torch.distributed.tensor)
# or the pipeline's backward (torch._dynamo, through torch.distributed.pipelining): about 0.6 CPU s each, paid here
# once for every rank forked below (four test files of tensor, context and pipeline parallelism: 113 -> 71 CPU s).
# Torch's modules only, never the toolkit's: a grading's ranks import every toolkit module themselves, where the
# delegation watch sees them.
PRELOAD = ("torch.distributed.tensor", "torch._dynamo")

try:
    from . import fresh_interpreter
except ImportError:  # run by path (`python zygote.py FD`, or by the graders' fork server): its sibling by path too
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "_toolkit_fresh_interpreter", os.path.join(_HERE, "fresh_interpreter.py")
    )
    fresh_interpreter = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(fresh_interpreter)


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
        fresh_interpreter.become(request["env"], request["cwd"], request["signals"])
        spec = importlib.util.spec_from_file_location("_toolkit_keeper", _KEEPER)
        keeper = importlib.util.module_from_spec(spec)
        sys.modules["_toolkit_keeper"] = keeper
        spec.loader.exec_module(keeper)

        def start_rank(folder: str, rank: int, fd: int, env: dict):
            pid = os.fork()
            if pid == 0:
                fresh_interpreter.become(env, signals=request["signals"])
                fresh_interpreter.run_worker(folder, fd, writers[rank:])  # the keeper closed those of the ranks before
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

        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except ImportError:  # another torch: its ranks import what they need themselves
                pass
    except BaseException as exc:  # noqa: BLE001 - the launcher says why and starts ranks the slow way
        send(control, {"error": f"import torch failed: {type(exc).__name__}: {exc}"})
        os._exit(1)
    fresh_interpreter.START.update(cwd=os.getcwd(), path=list(sys.path), signals=fresh_interpreter.launcher_signals())
    say_ready(control)
    serve(control, child)
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]))
