"""A Ctrl-C at any moment of a launch: KeyboardInterrupt reaches the caller promptly, and nothing is left behind.

A tracer (`interrupting.Lines`) counts the lines the launcher runs in `toolkit/runtime/` and sends the process SIGINT
at the k-th one. Swept over the start-up (from asking for the keeper to waiting for the ranks) and over the teardown
(a second Ctrl-C while the first unwinds), each launch must raise KeyboardInterrupt, leave no keeper, rank or zygote
of its own, remove its folder and give SIGINT back its handler. TOOLKIT_INTERRUPT_EVERY_LINE=1 sweeps every line
instead of a sample (a few minutes).
"""

import os
import signal
import sys
import time
import types

import pytest
from interrupting import Lines, ctrl_c, interrupt_in, kill_leftovers, sample  # noqa: F401 (ctrl_c: a fixture)

import toolkit
from toolkit.runtime import interrupts, zygote_link, zygotes

pytestmark = pytest.mark.timeout(240)
launch_module = sys.modules["toolkit.runtime.launch"]  # (toolkit.runtime.launch is the function)

RUNTIME = os.path.dirname(os.path.abspath(launch_module.__file__)) + os.sep
PATIENCE_S = 12.0  # stopping takes well under a second; a keeper that missed its SIGTERM is killed after 15 s


def _lines(at=()) -> Lines:
    return Lines(RUNTIME, at)


def _sleepy():
    time.sleep(60)


def _interrupted_launch(monkeypatch, lines: Lines) -> float:
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


@pytest.mark.usefixtures("ctrl_c")
def test_a_ctrl_c_at_any_line_of_a_launchs_start_up_or_teardown_stops_everything(monkeypatch, no_leftover_ranks):
    toolkit.launch(lambda: 0, 2, timeout_s=60)  # the zygote for this environment is up (its start: the next test)
    whole = _lines()
    with monkeypatch.context() as m:  # the Ctrl-C a user gives: while the ranks run
        waiting = interrupt_in(m, launch_module, "_watch", whole)
        _interrupted_launch(m, whole)
    names, waiting = whole.seen, waiting[0]
    asked = names.index("fork_keeper")  # from asking for the keeper (its zygote found) to waiting for the ranks
    assert asked < waiting < len(names), (asked, waiting, len(names))
    for k in sample(asked, waiting, 14):
        _interrupted_launch(monkeypatch, _lines([k]))
    for k in sample(waiting + 1, len(names), 4):  # and a second Ctrl-C while the first unwinds (stop, the folder)
        with monkeypatch.context() as m:
            lines = _lines([k])
            interrupt_in(m, launch_module, "_watch", lines)
            _interrupted_launch(m, lines)


@pytest.mark.usefixtures("ctrl_c")
def test_a_ctrl_c_while_a_zygote_starts_or_a_fresh_interpreter_keeper_starts_leaves_nothing(
    monkeypatch, no_leftover_ranks
):
    """The start-up's other paths: a zygote that imports torch for a new environment (SIGINT acts at once, and the
    zygote is killed: it would serve nobody), and a keeper started as a fresh interpreter (TOOLKIT_LAUNCH_EXEC=1)."""
    monkeypatch.setattr(zygotes, "MAX_ZYGOTES", 100)  # no zygote of the other tests is let go for these
    started = zygotes.pids()
    monkeypatch.setenv("TOOLKIT_INTERRUPT_TEST", "count")  # a new environment: a new zygote starts
    whole = _lines()
    with monkeypatch.context() as m:
        greeted = interrupt_in(m, zygote_link.Zygote, "_greeted", whole)
        took = _interrupted_launch(m, whole)
    assert took < 10, f"a Ctrl-C while a zygote imported torch took {took:.1f} s"
    for k in sample(whole.seen.index("_zygote_for"), greeted[0], 5):
        monkeypatch.setenv("TOOLKIT_INTERRUPT_TEST", str(k))
        _interrupted_launch(monkeypatch, _lines([k]))
    assert zygotes.pids() == started, "an interrupted zygote start left a zygote in the pool"

    monkeypatch.setenv("TOOLKIT_LAUNCH_EXEC", "1")
    whole = _lines()
    with monkeypatch.context() as m:
        waiting = interrupt_in(m, launch_module, "_watch", whole)
        _interrupted_launch(m, whole)
    for k in sample(whole.seen.index("start"), waiting[0], 4):
        _interrupted_launch(monkeypatch, _lines([k]))


def _nested():
    with interrupts.held():
        with interrupts.taken():
            time.sleep(0)
        time.sleep(0)


@pytest.mark.usefixtures("ctrl_c")
def test_a_ctrl_c_at_any_line_of_nested_stretches_reaches_the_caller_and_gives_sigint_back_its_handler():
    """Every line, the line event of the inner `with`'s exit among them: the interrupt lands before its `__exit__`
    runs, which then never does; the outer stretch still ends everything opened inside it."""
    here = os.path.abspath(__file__)
    whole = Lines(here)
    sys.settrace(whole)
    _nested()
    sys.settrace(None)
    for k in range(1, len(whole.seen) + 1):
        sys.settrace(Lines(here, [k]))
        try:
            with pytest.raises(KeyboardInterrupt):
                _nested()
        finally:
            sys.settrace(None)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler and not interrupts._taking, whole.seen
