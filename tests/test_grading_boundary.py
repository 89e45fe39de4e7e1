"""The process boundary between a submission and its grader (issue 29): each test replays an attack of the
issue's trial that broke the grader, and failed before the construction it tests.

What a submission's side can hand the grader is material, never an instruction: no file is read through a link
or past a cap, no text can change how a report looks, and the command line says what it was given wrong. The
cheap ones (no rank started, or one grading) run in the suite; the rest carry `grading_scale`."""
import json
import os
import threading
import time
from pathlib import Path

import pytest
from test_grading_attacks import CHECKS, SKELETON, SOLUTION, TASKS, _gradescope, _submission, lab  # noqa: F401

from toolkit.grading import CheckResult, Score, format_score, grade, main
from toolkit.grading.report import render

LABS = Path(__file__).resolve().parent.parent / "labs"
AT_SCALE = pytest.mark.grading_scale

# An exception's text as a student would write it to fake a full score: conceal what follows (ESC[8m), move to the
# line's start, draw a green score, and separators that some viewers break lines at.
FAKE = ("\x1b[8m hidden \x1b[0m\r\x1b[2K\x1b[32mScore: 13/13\x1b[0m\u2028Score: 13/13\u2029\u202eScore: 13/13"
        "\x1b]0;title\x07\x00\x7f\u200b")
UNSAFE = ("\x1b", "\r", "\u2028", "\u2029", "\u202e", "\x00", "\x7f", "\u200b", "\x07")


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def test_feedback_cannot_fake_a_score_line_in_any_format():
    score = Score("labs/x", f"mine{FAKE}.py", [CheckResult("ring", 2, 0, f"ValueError: {FAKE}\nsecond line"),
                                                CheckResult("secret", 1, 0, "a sentence", hidden=True, detail=FAKE)])
    text = format_score(score)
    assert not any(c in text for c in UNSAFE), repr(text)
    assert [line for line in text.splitlines() if line.startswith("Score")] == ["Score: 0/3"], text
    assert "\\x1b[32mScore: 13/13" in text and "\\u2028" in text  # shown, harmless, for the student to see
    assert "         second line" in text  # a message's own lines stay lines, indented under their check
    for fmt in ("json", "gradescope"):
        strings = list(_strings(json.loads(render(score, fmt))))
        assert strings and not any(c in s for s in strings for c in UNSAFE), (fmt, strings)


def test_grade_names_the_lab_a_short_name_meant(capsys):
    assert main([str(LABS / "01"), "--format", "json"]) == 2
    said = capsys.readouterr().err
    assert "is not a lab folder (no such folder)" in said and f"Did you mean {LABS / '01-ring-allreduce'}?" in said
    assert "12-pipeline" in said and "06-zero" in said, said  # and every lab there, to choose from


def test_a_report_written_to_output_is_not_printed_too(lab, tmp_path, capsys):
    """--output: "write the report here instead of printing it" (issue 32). A file that does not parse is graded
    without starting a rank, so this costs no launch; its name carries escapes, which the report shows harmlessly."""
    broken = tmp_path / "mine\x1b[8m.py"
    broken.write_text("def total(xs):\n    return (\n")
    results = tmp_path / "results.json"
    assert main([str(lab), "--solution", str(broken), "--format", "gradescope", "--output", str(results)]) == 1
    printed = capsys.readouterr()
    assert printed.out == "" and str(results) in printed.err, printed
    report = json.loads(results.read_text())
    assert report["score"] == 0 and "SyntaxError" in report["tests"][0]["output"]
    assert "\x1b" not in json.dumps(report, ensure_ascii=False) and "\\x1b[8m" in report["output"], report["output"]


# --- nothing follows a link ----------------------------------------------------------------------------------
def test_a_solution_that_is_a_link_is_refused(lab, tmp_path):
    """A link to the lab's own solution.py scored full marks: the grader read it through the link."""
    link = tmp_path / "mine.py"
    link.symlink_to(lab / "solution.py")
    results = tmp_path / "results.json"
    assert main([str(lab), "--solution", str(link), "--format", "gradescope", "--output", str(results), "--quiet"]) == 2
    report = json.loads(results.read_text())
    assert report["score"] == 0 and "is a link" in report["output"] and "copy the file itself" in report["output"]


def test_a_class_folders_links_are_refused_not_followed(lab, tmp_path):
    from toolkit.grading.classroom import grade_class

    submissions = tmp_path / "submissions"
    (submissions / "bob").mkdir(parents=True)
    (submissions / "alice.py").symlink_to(lab / "solution.py")            # a file that is a link
    (submissions / "bob" / "ring.py").symlink_to(lab / "solution.py")     # a link inside a student's folder
    (submissions / "carol").symlink_to(lab)                               # a student's folder that is a link
    rows = {r.student: r for r in grade_class(lab, submissions, tmp_path / "scores.csv", progress=False)}
    assert {s: (r.score, r.status.split(":")[0]) for s, r in rows.items()} == \
        {"alice": (0, "refused"), "bob": (0, "refused"), "carol": (0, "refused")}, rows
    assert "is a link" in rows["alice"].status and "is a link" in rows["bob"].status


@pytest.mark.timeout(60)
@pytest.mark.parametrize("planted", ["a link to a FIFO", "a FIFO", "a link to /dev/zero", "a huge file"])
def test_a_planted_result_file_is_refused_at_once(planted, tmp_path):
    """A rank's result planted as a link to a FIFO held the grader in open() for good; to /dev/zero it read
    without end. The grader's reader opens without following links or blocking, and reads a capped regular file."""
    from toolkit.grading import session, wire

    path = tmp_path / "check-0-rank-0.json"
    if "FIFO" in planted:
        os.mkfifo(tmp_path / "fifo")
    if planted == "a link to a FIFO":
        path.symlink_to(tmp_path / "fifo")
    elif planted == "a FIFO":
        os.mkfifo(path)
    elif planted == "a link to /dev/zero":
        path.symlink_to("/dev/zero")
    else:
        with open(path, "wb") as f:
            f.truncate(wire.MAX_BYTES + 1)  # sparse: costs no disk
    found = []
    reader = threading.Thread(target=lambda: found.append(session._read(path)), daemon=True)
    started = time.monotonic()
    reader.start()
    reader.join(timeout=10)
    assert found, f"the grader's reader was still in {planted} after 10 s"
    assert time.monotonic() - started < 5 and "cannot read" in found[0]["error"], found


@pytest.mark.timeout(300)
def test_run_autograder_refuses_a_submission_that_is_a_link(lab, tmp_path):
    """Gradescope's run_autograder graded a submitted link to the lab's solution.py: 14/14 on lab 10."""
    import subprocess
    import sys

    root = tmp_path / "autograder"
    (root / "source" / "labs").mkdir(parents=True)
    (root / "submission").mkdir()
    (root / "source" / "labs" / "lab").symlink_to(lab)
    (root / "source" / "LAB").write_text("lab\n")
    (root / "submission" / "skeleton.py").symlink_to(lab / "solution.py")
    env = dict(os.environ, AUTOGRADER_ROOT=str(root), PYTHON=sys.executable)
    done = subprocess.run([str(LABS / "autograder" / "run_autograder")], env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr
    results = json.loads((root / "results" / "results.json").read_text())
    assert results["score"] == 0 and "is a link" in results["output"], results
