"""A process forked from a zygote becomes what a fresh interpreter started by the launcher would be.

The zygote (`zygote.py`) imported torch once and forks every launch's keeper; the keeper forks the ranks. Each of
them then calls `become`: the launcher's environment replaces the zygote's wholesale, its working directory,
sys.path recomputed from them as `python -m` computes it, the signal dispositions and mask the launcher had when it
asked (`launcher_signals`: exec keeps what is ignored and blocked, so a rank of a `nohup`'d launcher ignores SIGHUP,
whichever process started the zygote), fresh import caches; a rank then makes stdout and stderr for its new
descriptors, a session of its own, and runs the worker (`run_worker`). What fork cannot redo: the string hash seed
is the zygote's (it is chosen once per interpreter), and /proc/<pid>/environ and cmdline show the zygote's start
(`zygotes.py` starts a new zygote whenever the launcher's environment differs from the one it started in).

Standard library only: the zygote loads this file by path, and `toolkit` itself is never imported there.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
import traceback

START = {}  # where the zygote started (cwd, sys.path, signals): what a rank's sys.path is recomputed from


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


def stdio(fd: int, name: str):
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

    _fresh_signals(signals or START["signals"])
    main = threading.main_thread()  # fork made this thread the main one, but kept the zygote's thread id as its
    if hasattr(main, "_set_native_id"):  # native_id (CPython gh-132542, fixed in 3.13): /proc/self/task/<it> is gone
        main._set_native_id()
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    here = os.getcwd()
    # sys.path as `python -m` computes it: the working directory first (not with PYTHONSAFEPATH, as python -P),
    # then PYTHONPATH (relative entries resolved against the working directory), then the interpreter's own
    start_cwd, start_path = START["cwd"], START["path"]
    moved = {
        os.path.abspath(os.path.join(start_cwd, p)): os.path.abspath(os.path.join(here, p))
        for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if p and not os.path.isabs(p)
    }
    start = start_path if getattr(sys.flags, "safe_path", False) else start_path[1:]  # [0]: where it started, if put
    sys.path[:] = ([] if os.environ.get("PYTHONSAFEPATH") else [here]) + [moved.get(p, p) for p in start]
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
        sys.stdout = sys.__stdout__ = stdio(1, "<stdout>")
        sys.stderr = sys.__stderr__ = stdio(2, "<stderr>")
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
