"""A Ctrl-C at any moment of a grading's start-up or teardown: KeyboardInterrupt reaches the instructor promptly,
and nothing of the grading is left: no launcher, rank, grading's fork server or volume holder, no folder.

The tracer of `interrupting.Lines` counts the lines the grader runs in `toolkit/grading/` and sends SIGINT at the
k-th one, swept from the grading's start (its Sandbox, its Box with the volume holder) to the overseer's wait for
the ranks, and over the teardown (a second Ctrl-C while the first unwinds). The submission sleeps on import: a
Ctrl-C that was lost lets the grading end with a score after the time limit, not with KeyboardInterrupt.
"""

import os
import signal
import sys
import tempfile
import time
import types
from pathlib import Path
from uuid import uuid4

import pytest
from interrupting import Lines, ctrl_c, interrupt_in, kill_leftovers, sample  # noqa: F401 (ctrl_c: a fixture)

from toolkit.grading import Limits, grade, isolation, overseer, student_wheel
from toolkit.runtime import zygotes

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("ctrl_c")]
box_module = sys.modules["toolkit.grading.box"]

GRADING = os.path.dirname(os.path.abspath(overseer.__file__)) + os.sep
LAB = Path(__file__).resolve().parent.parent / "labs" / "01-ring-allreduce"
LIMITS = Limits(time_limit_s=2)  # a lost Ctrl-C: the import overruns and the grading ends in about 12 s
PATIENCE_S = 12.0  # stopping a launch takes well under a second (its launcher is killed 5 s after a SIGTERM)


def _ours() -> list[int]:
    """Our own child processes but the zygotes (kept for later launches and gradings, by design)."""
    pool = set(zygotes.pids())
    return [pid for pid in isolation._children() if pid not in pool]


def _interrupted_grading(monkeypatch, submission: Path, lines: Lines) -> float:
    """Grade `submission` with the tracer on; the seconds until KeyboardInterrupt reached us."""
    grading_id, folders = uuid4().hex, []
    monkeypatch.setenv(isolation.MARKER, grading_id)  # the grading's Sandbox takes it as its id

    def mkdtemp(**kw):
        folders.append(tempfile.mkdtemp(**kw))
        return folders[-1]

    def last_sweep(sandbox):  # what its owner had not stopped (the submission's own daemons, were there any)
        swept.extend(isolation.marked(sandbox.id))
        sweep(sandbox)

    swept, sweep = [], isolation.Sandbox.stop_everything
    monkeypatch.setattr(box_module, "tempfile", types.SimpleNamespace(mkdtemp=mkdtemp))
    monkeypatch.setattr(isolation.Sandbox, "stop_everything", last_sweep)
    started = time.monotonic()
    sys.settrace(lines)
    try:
        with pytest.raises(KeyboardInterrupt):
            grade(LAB, submission, quiet=True, limits=LIMITS)
    finally:
        sys.settrace(None)
        took = time.monotonic() - started
        left = sorted(set(isolation.marked(grading_id)) | set(_ours()))
        isolation.stop(grading_id, all_children=False)
        kill_leftovers()
    monkeypatch.undo()
    where = f"a Ctrl-C at line(s) {sorted(lines.at)}"
    assert not left, f"processes of the grading left running after {where}: {left}"
    assert not swept, f"after {where}, the grader's own processes were left to the grading's last sweep: {swept}"
    assert not [f for f in folders if os.path.exists(f)], f"the grading's folder was left after {where}: {folders}"
    assert took < PATIENCE_S, f"{where} took {took:.1f} s to reach the caller"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, f"{where} left a SIGINT handler"
    return took


def _sweep(monkeypatch, tmp_path, spread: int, launching: int, making: int, unwinding: int) -> None:
    """A grading interrupted where an instructor would (while the ranks run), then at sampled lines: `spread` over
    the whole start-up, `launching` from asking for the launcher to the wait, `making` while the grading's volume
    is made, and `unwinding` a second Ctrl-C during the teardown."""
    submission = tmp_path / "sleepy.py"
    submission.write_text("import time\n\ntime.sleep(60)\n")
    student_wheel.for_lab(LAB)  # built (once per toolkit and lab) before the lines are counted: each grading alike
    whole = Lines(GRADING)
    with monkeypatch.context() as m:
        waiting = interrupt_in(m, overseer.Overseer, "run", whole)
        _interrupted_grading(m, submission, whole)
    names, waiting = whole.seen, waiting[0]
    begun, volume, launcher = (names.index(name) + 1 for name in ("__enter__", "_volumes", "_start_launcher"))
    assert begun < volume < launcher < waiting < len(names), (begun, volume, launcher, waiting, len(names))
    at = sample(begun, waiting, spread) if spread else []
    at += sample(launcher, waiting, launching) + sample(volume, names.index("launch_ranks") + 1, making)
    for k in sorted(set(at)):
        _interrupted_grading(monkeypatch, submission, Lines(GRADING, [k]))
    for k in sample(waiting + 1, len(names), unwinding):
        with monkeypatch.context() as m:
            lines = Lines(GRADING, [k])
            interrupt_in(m, overseer.Overseer, "run", lines)
            _interrupted_grading(m, submission, lines)


def test_a_ctrl_c_while_a_grading_starts_its_launcher_or_unwinds_leaves_nothing(monkeypatch, tmp_path):
    """Where a process is asked for and owned: the launcher forked by the grading's server, the volume's holder."""
    _sweep(monkeypatch, tmp_path, spread=0, launching=4, making=1, unwinding=1)


@pytest.mark.grading_scale
def test_a_ctrl_c_at_any_line_of_a_gradings_start_up_or_teardown_leaves_nothing(monkeypatch, tmp_path):
    _sweep(monkeypatch, tmp_path, spread=14, launching=8, making=4, unwinding=4)
