"""The autograder for labs/: a submission is untrusted code; it runs in processes of its own, and only the
grader's side decides and writes a result.

    python -m toolkit grade labs/01-ring-allreduce [--solution my_ring.py] [--format text|json|gradescope]
    python -m toolkit grade labs/01-ring-allreduce --class submissions/ --csv scores.csv
    python -m toolkit release labs/ --out student-labs/ [--wheel]

A lab's `checks.py` is written with `check`, `Judge` and `CheckFailed` (`grading.checks`), its `tasks.py`
with `on_rank.Rank`. `grade` (`grading.grader`) runs the tasks next to the student's code in a sandbox
(`session`, `runner`, `sandbox`, `watchdog`, `isolation`), reads back what they observed (`wire`) and
judges it (`model_labs`: the tiny-GPT labs' inputs and reference); `delegation` spots a submission that calls the
toolkit's own answer; `report` turns a score
into JSON or Gradescope's results.json; `classroom` grades a folder of submissions; `release` makes the
students' copy of labs/ and `student_wheel` the toolkit without the labs' answers.
"""
from .checks import Check, CheckFailed, Judge, check, number, seconds, show, sibling
from .cli import class_command, grade_command, main
from .grader import grade, lab_checks
from .score import CheckResult, Score, format_score
from .session import Limits

__all__ = ["Check", "CheckFailed", "CheckResult", "Judge", "Limits", "Score", "check", "class_command",
           "format_score", "grade", "grade_command", "lab_checks", "main", "number", "seconds", "show",
           "sibling"]
