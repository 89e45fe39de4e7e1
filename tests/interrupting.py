"""A Ctrl-C at a chosen line: what tests/test_launch_interrupts.py and tests/test_grading_interrupts.py share.

A tracer counts the lines the code under test runs in one folder of the package and sends the process SIGINT at
the k-th one, as a Ctrl-C (or a notebook's stop button: Jupyter sends the kernel SIGINT) landing exactly there.
TOOLKIT_INTERRUPT_EVERY_LINE=1 sweeps every line instead of a sample (`sample`).
"""

import os
import signal

import pytest
from conftest import _children


class Lines:
    """sys.settrace: count the lines run in files under `folder` (this thread only); SIGINT at the k-th for k in
    `at`. (A KeyboardInterrupt raised inside the tracer ends the tracing: the rest of that run is not counted.)"""

    def __init__(self, folder: str, at=()):
        self.folder, self.at, self.seen = folder, set(at), []

    def __call__(self, frame, event, arg):
        return self._line if frame.f_code.co_filename.startswith(self.folder) else None

    def _line(self, frame, event, arg):
        if event == "line":
            self.seen.append(frame.f_code.co_name)
            if len(self.seen) in self.at:
                signal.raise_signal(signal.SIGINT)
        return self._line


@pytest.fixture
def ctrl_c():
    """SIGINT raises KeyboardInterrupt here, as in a terminal or a notebook (not so where the suite was started in
    the background by a shell without job control, which ignores it), and nothing leaves its handler behind."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "a SIGINT handler was left behind"
    signal.signal(signal.SIGINT, before)


def kill_leftovers() -> list[int]:
    """Kill what this process's launches left (so that one failure never fails the next tests); what it was."""
    left = sorted(_children())
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def sample(first: int, last: int, count: int) -> list[int]:
    """`count` line numbers spread from `first` to `last` (every one with TOOLKIT_INTERRUPT_EVERY_LINE=1)."""
    if os.environ.get("TOOLKIT_INTERRUPT_EVERY_LINE") == "1":
        return list(range(first, last + 1))
    return sorted({round(first + i * (last - first) / max(1, count - 1)) for i in range(count)})


def interrupt_in(monkeypatch, owner, name: str, lines: Lines) -> list[int]:
    """SIGINT on entering `owner.name` (outside the tracer, which goes on counting); the line count then, once."""
    real, entered = getattr(owner, name), []

    def interrupted(*args, **kwargs):
        entered.append(len(lines.seen))
        signal.raise_signal(signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, interrupted)
    return entered
