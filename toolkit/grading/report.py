"""A score in the forms people and course platforms read: text, plain JSON, Gradescope's results.json.

Gradescope's autograder reads `/autograder/results/results.json`:

    {"score": 9.0, "max_score": 13.0, "output": "...", "execution_time": 41.2,
     "tests": [{"name": "...", "number": "1", "score": 2.0, "max_score": 2.0, "status": "passed",
                "output": "...", "visibility": "visible"}, ...]}

A check from the lab's `checks.py` is "visible" (the student ran it locally too); one from the
instructor's `hidden_checks.py` is "after_published": its score and message appear once grades are
published. The plain JSON form carries the same facts under the toolkit's own names, plus, for a hidden check, the
`detail` the instructor's reports may show (never Gradescope's: it would reach the student).

Exit codes of `python -m toolkit grade` (a script can branch on them):

    0  graded, full marks
    1  graded, not full marks (the report says which checks failed and why)
    2  nothing graded: bad arguments, no such lab, no such solution file
    3  nothing graded: the grader itself failed (a bug or a broken installation, not the student's)
"""

from __future__ import annotations

import json

FULL_MARKS, PARTIAL, USAGE_ERROR, GRADER_ERROR = 0, 1, 2, 3
FORMATS = ("text", "json", "gradescope")


def exit_code(score) -> int:
    return FULL_MARKS if score.total == score.maximum else PARTIAL


def as_json(score, elapsed_s: float | None = None) -> dict:
    """The plain form: lab, solution, score, max_score, and every check with its points and message."""
    from .score import shown

    score = shown(score)
    return {
        "lab": score.lab,
        "solution": score.solution,
        "score": score.total,
        "max_score": score.maximum,
        "execution_time": None if elapsed_s is None else round(elapsed_s, 2),
        "sandbox": score.sandbox,
        "checks": [
            {
                "name": r.name,
                "score": r.earned,
                "max_score": r.points,
                "passed": r.passed,
                "message": r.message,
                "hidden": r.hidden,
                **({"detail": r.detail} if r.detail else {}),
                **({"platform_only": True} if r.platform_only else {}),
            }
            for r in score.results
        ],
    }


def nothing_graded(message: str, fmt: str) -> str:
    """The report when no score could be produced (bad arguments, the grader's own failure): a platform
    still gets a well-formed file that says so, with a score of 0."""
    from .untrusted import clean

    message = clean(message)
    if fmt == "gradescope":
        return json.dumps({"score": 0.0, "output": message, "visibility": "visible", "tests": []}, indent=2)
    if fmt == "json":
        return json.dumps({"score": 0, "max_score": None, "error": message, "checks": []}, indent=2)
    return message


def as_gradescope(score, elapsed_s: float | None = None) -> dict:
    """Gradescope's results.json schema (see the module docstring)."""
    from .score import format_score, shown

    score = shown(score)
    tests = []
    for number, r in enumerate(score.results, 1):
        tests.append(
            {
                "name": r.name,
                "number": str(number),
                "score": float(r.earned),
                "max_score": float(r.points),
                "status": "passed" if r.passed else "failed",
                "output": r.message or "passed",
                "visibility": "after_published" if r.hidden else "visible",
            }
        )
    summary = format_score(_visible_only(score))
    hidden = sum(r.points for r in score.results if r.hidden)
    if hidden:
        summary = summary.replace("\nScore: ", "\nScore of the checks shown here: ") + (
            f"\n(and {hidden} point{'s' * (hidden != 1)} in checks shown once grades are published)"
        )
    result = {
        "score": float(score.total),
        "max_score": float(score.maximum),
        "output": summary,
        "visibility": "visible",
        "stdout_visibility": "hidden",
        "tests": tests,
    }
    if elapsed_s is not None:
        result["execution_time"] = round(elapsed_s, 2)
    return result


def _visible_only(score):
    """The summary shown before grades are published must not reveal the hidden checks' messages."""
    from dataclasses import replace

    return replace(score, results=[r for r in score.results if not r.hidden])


def render(score, fmt: str, elapsed_s: float | None = None) -> str:
    """The score as text (the report a student reads), json or gradescope."""
    from .score import format_score

    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {FORMATS}.")
    if fmt == "text":
        return format_score(score)
    value = as_json(score, elapsed_s) if fmt == "json" else as_gradescope(score, elapsed_s)
    return json.dumps(value, indent=2)
