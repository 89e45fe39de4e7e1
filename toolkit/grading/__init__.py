"""The autograder for labs/: checks run on real ranks against a student's file, and a score that explains.

    python -m toolkit grade labs/01-ring-allreduce [--solution my_ring.py] [--format text|json|gradescope]
    python -m toolkit grade labs/01-ring-allreduce --class submissions/ --csv scores.csv
    python -m toolkit release labs/ --out student-labs/

A lab's checks.py is written with `check`, `Context` and `CheckFailed` (see `grading.checks`);
`grade` runs them (`grading.grader`), safely (`watchdog`, `isolation`); `report` turns a score into
JSON or Gradescope's results.json; `classroom` grades a folder of submissions; `release` makes the
students' copy of labs/ without the solutions.
"""
from .checks import Check, CheckFailed, Context, Message, check, show
from .cli import class_command, grade_command, main
from .grader import CheckResult, Limits, Score, format_score, grade

__all__ = ["Check", "CheckFailed", "CheckResult", "Context", "Limits", "Message", "Score", "check",
           "class_command", "format_score", "grade", "grade_command", "main", "show"]
