"""A Ctrl-C at any moment of a launch: KeyboardInterrupt reaches the caller promptly, and nothing is left behind.

A tracer counts the lines the launcher runs in `toolkit/runtime/` and sends the process SIGINT at the k-th one, as a
Ctrl-C (or a notebook's stop button: Jupyter sends the kernel SIGINT) landing exactly there. Swept over the start-up
(from asking for the keeper to waiting for the ranks) and over the teardown (a second Ctrl-C while the first unwinds),
each launch must raise KeyboardInterrupt, leave no keeper, rank or zygote of its own, remove its folder and give
SIGINT back its handler. TOOLKIT_INTERRUPT_EVERY_LINE=1 sweeps every line instead of a sample (a few minutes).
"""

import os
import signal
import sys
import time
import types

import pytest
from conftest import _children

import toolkit
from toolkit.runtime import zygote_link, zygotes

pytestmark = pytest.mark.timeout(240)
launch_module = sys.modules["toolkit.runtime.launch"]  # (toolkit.runtime.launch is the function)

RUNTIME = os.path.dirname(os.path.abspath(launch_module.__file__)) + os.sep
PATIENCE_S = 12.0  # stopping takes well under a second; a keeper that missed its SIGTERM is killed after 15 s


def _sleepy():
    time.sleep(60)


class _Lines:
    """sys.settrace: count the lines run in toolkit/runtime/ (this thread only); SIGINT at the k-th for k in `at`.
    (A KeyboardInterrupt raised inside the tracer ends the tracing: the rest of that launch is not counted.)"""

    def __init__(self, at=()):
        self.at, self.seen = set(at), []

    def __call__(self, frame, event, arg):
        return self._line if frame.f_code.co_filename.startswith(RUNTIME) else None

    def _line(self, frame, event, arg):
        if event == "line":
            self.seen.append(frame.f_code.co_name)
            if len(self.seen) in self.at:
                signal.raise_signal(signal.SIGINT)
        return self._line


@pytest.fixture
def ctrl_c():
    """SIGINT raises KeyboardInterrupt here, as in a terminal or a notebook (not so where the suite was started in
    the background by a shell without job control, which ignores it), and no launch leaves its handler behind."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "a launch left its SIGINT handler"
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


def _interrupted_launch(monkeypatch, lines: _Lines) -> float:
    """Launch ranks that sleep for a minute with the tracer on; the seconds until KeyboardInterrupt reached us."""
    folders = []

    class Folder(launch_module.tempfile.TemporaryDirectory):
        def __init__(self, **kw):
            super().__init__(**kw)
            folders.append(self.name)

    monkeypatch.setattr(launch_module, "tempfile", types.SimpleNamespace(TemporaryDirectory=Folder))
    started = time.monotonic()
    sys.settrace(lines)
    try:
        # deadline_s: a Ctrl-C that was lost would end the launch as RankError, not KeyboardInterrupt
        with pytest.raises(KeyboardInterrupt):
            toolkit.launch(_sleepy, 2, timeout_s=300, deadline_s=PATIENCE_S)
    finally:
        sys.settrace(None)
        took, left = time.monotonic() - started, kill_leftovers()
    assert not left, f"processes left running after a Ctrl-C at line(s) {sorted(lines.at)}: {left}"
    assert folders and not os.path.exists(folders[0]), f"the launch's folder was left: {folders}"
    assert took < PATIENCE_S, f"a Ctrl-C at line(s) {sorted(lines.at)} took {took:.1f} s to reach the caller"
    return took


def _sample(first: int, last: int, count: int) -> list[int]:
    if os.environ.get("TOOLKIT_INTERRUPT_EVERY_LINE") == "1":
        return list(range(first, last + 1))
    return sorted({round(first + i * (last - first) / max(1, count - 1)) for i in range(count)})


def _interrupt_in(monkeypatch, owner, name: str, lines: _Lines) -> list[int]:
    """SIGINT on entering `owner.name` (outside the tracer, which goes on counting); the line count then, once."""
    real, entered = getattr(owner, name), []

    def interrupted(*args):
        entered.append(len(lines.seen))
        signal.raise_signal(signal.SIGINT)
        return real(*args)

    monkeypatch.setattr(owner, name, interrupted)
    return entered


def test_a_ctrl_c_at_any_line_of_a_launchs_start_up_or_teardown_stops_everything(
    monkeypatch, ctrl_c, no_leftover_ranks
):
    toolkit.launch(lambda: 0, 2, timeout_s=60)  # the zygote for this environment is up (its start: the next test)
    whole = _Lines()
    with monkeypatch.context() as m:  # the Ctrl-C a user gives: while the ranks run
        waiting = _interrupt_in(m, launch_module, "_watch", whole)
        _interrupted_launch(m, whole)
    names, waiting = whole.seen, waiting[0]
    asked = names.index("fork_keeper")  # from asking for the keeper (its zygote found) to waiting for the ranks
    assert asked < waiting < len(names), (asked, waiting, len(names))
    for k in _sample(asked, waiting, 14):
        _interrupted_launch(monkeypatch, _Lines([k]))
    for k in _sample(waiting + 1, len(names), 4):  # and a second Ctrl-C while the first unwinds (stop, the folder)
        with monkeypatch.context() as m:
            lines = _Lines([k])
            _interrupt_in(m, launch_module, "_watch", lines)
            _interrupted_launch(m, lines)


def test_a_ctrl_c_while_a_zygote_starts_or_a_fresh_interpreter_keeper_starts_leaves_nothing(
    monkeypatch, ctrl_c, no_leftover_ranks
):
    """The start-up's other paths: a zygote that imports torch for a new environment (SIGINT acts at once, and the
    zygote is killed: it would serve nobody), and a keeper started as a fresh interpreter (TOOLKIT_LAUNCH_EXEC=1)."""
    monkeypatch.setattr(zygotes, "MAX_ZYGOTES", 100)  # no zygote of the other tests is let go for these
    started = zygotes.pids()
    monkeypatch.setenv("TOOLKIT_INTERRUPT_TEST", "count")  # a new environment: a new zygote starts
    whole = _Lines()
    with monkeypatch.context() as m:
        greeted = _interrupt_in(m, zygote_link.Zygote, "_greeted", whole)
        took = _interrupted_launch(m, whole)
    assert took < 10, f"a Ctrl-C while a zygote imported torch took {took:.1f} s"
    for k in _sample(whole.seen.index("_zygote_for"), greeted[0], 5):
        monkeypatch.setenv("TOOLKIT_INTERRUPT_TEST", str(k))
        _interrupted_launch(monkeypatch, _Lines([k]))
    assert zygotes.pids() == started, "an interrupted zygote start left a zygote in the pool"

    monkeypatch.setenv("TOOLKIT_LAUNCH_EXEC", "1")
    whole = _Lines()
    with monkeypatch.context() as m:
        waiting = _interrupt_in(m, launch_module, "_watch", whole)
        _interrupted_launch(m, whole)
    for k in _sample(whole.seen.index("start"), waiting[0], 4):
        _interrupted_launch(monkeypatch, _Lines([k]))
