"""Where a live rank's Python code is, asked from outside: faulthandler's stack dump on SIGUSR1.

When the launcher names a rank that is still running (it never entered a collective its peers wait in,
it hangs, or the job ran past its deadline), the rank's own words are missing: it raised nothing. So each
rank arms `faulthandler` at start, and before the launcher stops the ranks it sends them SIGUSR1 and
shows the named rank's stack. faulthandler writes from a C signal handler, so this works while the rank
is inside a long C call (a matmul, a blocking receive) as well as in a Python loop.

The dump holds every thread (gloo's and the toolkit's own too); the rank writes its main thread's id
first, and the launcher shows that thread only, most recent call last, with the lines of source.
"""

from __future__ import annotations

import faulthandler
import linecache
import os
import re
import signal
import threading
import time

_SIGNAL = signal.SIGUSR1
_HEADER = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):$")
_FRAME = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')
# the launch's own frames, below the user's: the worker, and in a forked rank the zygote's and keeper's
_SKIP = (
    *(os.path.join("toolkit", "runtime", f) for f in ("worker.py", "zygote.py", "fresh_interpreter.py", "keeper.py")),
    "<frozen runpy>",
)


def path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"stack-{rank}")


# --- in the rank ------------------------------------------------------------------------------------------
def arm(folder: str, rank: int) -> None:
    """From now on SIGUSR1 appends this process's Python stacks to `stack-<rank>` (the rank keeps it open)."""
    f = open(path(folder, rank), "w")  # noqa: SIM115 - faulthandler writes to it until the process ends
    f.write(f"main 0x{threading.main_thread().ident:016x}\n")
    f.flush()
    faulthandler.register(_SIGNAL, file=f, all_threads=True, chain=False)
    arm.file = f  # keep it open (and referenced) for the process's whole life


# --- in the launcher --------------------------------------------------------------------------------------
def ask(folder: str, pids: dict[int, int], patience_s: float = 2.0) -> dict[int, str]:
    """{rank: its main thread's stack, as a traceback reads} for the ranks in `pids` ({rank: pid}) that answer.
    A dump is whole once its file has grown and then kept its size for one look (faulthandler writes it
    all at once, from the signal handler)."""
    before, seen = {}, {}
    for rank, pid in pids.items():
        try:
            before[rank] = os.path.getsize(path(folder, rank))
            os.kill(pid, _SIGNAL)
        except OSError:  # not armed yet, or ended meanwhile
            continue
    found, give_up = {}, time.monotonic() + patience_s
    while before and time.monotonic() < give_up:
        time.sleep(0.05)
        for rank in list(before):
            size = os.path.getsize(path(folder, rank))
            if size > before[rank] and seen.get(rank) == size:
                with open(path(folder, rank), errors="replace") as f:
                    found[rank] = _main_thread(f.read())
                del before[rank]
            seen[rank] = size
    return {rank: stack for rank, stack in found.items() if stack}


def _main_thread(text: str) -> str:
    """The main thread's block of the last dump, most recent call last, with source lines."""
    lines = text.splitlines()
    main = lines[0].split()[1] if lines and lines[0].startswith("main ") else None
    blocks, current = {}, None
    for line in lines[1:]:
        header = _HEADER.match(line)
        if header:
            current = blocks[header[1]] = []  # a later dump replaces an earlier one
        elif current is not None and (frame := _FRAME.match(line)):
            current.append((frame[1], int(frame[2]), frame[3]))
    frames = blocks.get(main) or []
    shown = []
    for filename, number, name in reversed(frames):
        if any(filename.endswith(s) for s in _SKIP):
            continue
        shown.append(f'  File "{filename}", line {number}, in {name}')
        source = linecache.getline(filename, number).strip()
        if source:
            shown.append(f"    {source}")
    return "\n".join(shown)
