"""The graders' fork server: a process that imported torch once and forks each grading's server, which forks
each launch's sandbox.

Without it every launch of a grading (a lab has one per world size, and one more after each deadlock)
started two fresh interpreters, each importing torch (about 2 s of CPU apiece): the launcher and the zygote
that forks its ranks. A process that grades many submissions (a notebook checking a lab again and again, the
test suite) would pay it once more per grading for the grading's own server. This file is the runtime's
zygote (`toolkit/runtime/zygote.py`) serving other children, at two levels:

1. Start: the grader runs it by path (`python forkserver.py FD`, so `toolkit` is never imported here), once per
   environment (`zygotes.server`, pooled as the ranks' zygotes are), with the gradings' common environment
   and a blank grading id. It imports torch, says it is ready, and waits. It holds nothing of the grader's:
   no check, no expected value, no solution.
2. Each grading (its environment and a control socket): fork the grading's server. It writes the grading's
   id over the blank where /proc shows its environment (`_carry`: every process forked below shows it, and
   the grader finds a grading's processes by it), takes the grading's environment, says it is ready and
   serves the grading's launches. It runs as the grader's user, outside the sandbox, and nothing in the
   sandbox can reach it (another domain, and `nobody` where grading as root).
3. Each launch (the spec's path and the writing end of the grader's pipe for its output): the grading's server
   forks the launch's *sandbox zygote*. It takes the pipe as stdout and stderr, a session of its own, dies with
   the server, and enters the launch's sandbox (`sandbox.enter`: namespaces, where it forks the namespaces'
   first process and waits for it; limits; `nobody` where root; landlock to the grading's folders), all before
   anything else. The students' toolkit (`student_wheel.for_lab`, in the grading's folder) goes first on its path.
4. The sandbox zygote forks the launcher (`launcher.main`, told to ask its parent for ranks), then serves
   it as the runtime's zygote does: a keeper per launch, and the keeper forks the ranks. Ranks thus start
   from a process that has torch but never imported `toolkit` (the delegation watcher must see every
   toolkit module a submission imports), already sandboxed. The launcher's end ends it.

The grader stops a launch as before (the sandbox zygote's session, then everything that carries the
grading's id, but the grading's server), and closes the grading's server when the grading ends.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import signal
import socket
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _by_path(name: str, path: str):
    """A standard-library-only module of the toolkit, loaded from its file (the package stays unimported)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


zygote = _by_path("_toolkit_zygote", os.path.join(_HERE, "..", "runtime", "zygote.py"))
fresh = zygote.fresh_interpreter  # what a forked child does to become a fresh interpreter
sandbox = _by_path("_toolkit_sandbox", os.path.join(_HERE, "sandbox.py"))


def _sandbox_zygote(request: dict, fds: list[int]) -> None:
    """In the forked child: the launch's log, its sandbox, then fork the launcher and serve it. Never returns."""
    code = 1
    try:
        server = os.getppid()
        os.setsid()
        os.dup2(fds[0], 1)
        os.dup2(fds[0], 2)
        os.close(fds[0])
        sys.stdout = sys.__stdout__ = fresh.stdio(1, "<stdout>")
        sys.stderr = sys.__stderr__ = fresh.stdio(2, "<stderr>")
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: dies with the server
        if os.getppid() != server:
            os._exit(1)
        fresh.become(request["env"], request["cwd"])
        with open(request["spec"]) as f:
            spec = json.load(f)  # out of the sandbox's reach once in it
        sandbox.enter(spec)  # may fork: this is then the launch's PID namespace's first process
        sys.path.insert(0, spec["lib"])  # the students' toolkit first, for the launcher, every keeper and rank
        fresh.START["path"][1:1] = [spec["lib"]]  # what a forked process recomputes its sys.path from
        zygote._KEEPER = os.path.join(spec["lib"], "toolkit", "runtime", "keeper.py")  # loaded by path
        ours, theirs = socket.socketpair()
        launcher = os.fork()
        if launcher == 0:
            ours.close()
            _launcher(spec, theirs, os.getppid())
        theirs.close()
        zygote.serve(ours)  # until the launcher is done (its end of the socket closes)
        try:
            code = os.waitstatus_to_exitcode(os.waitpid(launcher, 0)[1])
        except ChildProcessError:  # serve reaped it already, among its keepers
            code = 0
    except BaseException:  # noqa: BLE001 - said in the launch's log, which the grader shows
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code if isinstance(code, int) and code >= 0 else 1)


def _carry(name: str, value: str) -> None:
    """Write `name=value` over this process's `name=` entry in the environment block it started with, which is
    what /proc/<pid>/environ shows for it and for every process it forks (setproctitle does this for argv).
    The entry must have room for the value; what is left of it becomes an entry of padding."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    start, end = int(fields[47]), int(fields[48])  # env_start, env_end: fields 50 and 51 of proc(5)
    entry, at = name.encode() + b"=", 0
    for item in ctypes.string_at(start, end - start).split(b"\0"):
        if item.startswith(entry):
            break
        at += len(item) + 1
    else:
        raise RuntimeError(f"{name} is not in the environment this process started with")
    room, new = len(item) - len(entry), value.encode()
    if len(new) > room:
        raise RuntimeError(f"{name}: {len(new)} bytes do not fit in the {room} this process started with")
    padding = b"\0" + b"_" * (room - len(new) - 1) if len(new) < room else b""
    ctypes.memmove(start + at + len(entry), new + padding, room)
    with open("/proc/self/environ", "rb") as f:
        if name.encode() + b"=" + new not in f.read().split(b"\0"):
            raise RuntimeError(f"/proc/self/environ does not show the new {name}")


def _grading_server(request: dict, fds: list[int]) -> None:
    """In a child of the graders' server: one grading's server (its id carried, its environment), serving the
    grading's launches until the grader lets it go. Never returns."""
    code = 1
    control = socket.socket(fileno=fds[0])
    try:
        os.setsid()
        _carry(request["marker"], request["env"][request["marker"]])
        fresh.become(request["env"], request["cwd"])
        zygote.say_ready(control)
        zygote.serve(control, _sandbox_zygote)
        code = 0
    except BaseException as exc:  # noqa: BLE001 - the grader reads it as the reason it grades without a server
        try:
            zygote.send(control, {"error": f"the grading's server could not start: {type(exc).__name__}: {exc}"})
        except OSError:
            pass
    finally:
        os._exit(code)


def _launcher(spec: dict, control: socket.socket, parent: int) -> None:
    """In the launcher forked by the sandbox zygote: `launcher.main`, with its parent as the ranks' zygote."""
    code = 1
    try:
        from toolkit.grading import launcher

        code = launcher.main(spec=spec, zygote=(control, parent))
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 1
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
    finally:
        try:
            from toolkit.runtime import zygotes

            zygotes.close_all()  # atexit would, but os._exit skips it: the sandbox zygote waits for this
        except BaseException:  # noqa: BLE001
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    zygote.main(int(sys.argv[1]), child=_grading_server)
