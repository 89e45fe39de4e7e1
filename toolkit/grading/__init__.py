"""The autograder for labs/: checks run on real ranks against a student's file, and a score that explains.

    python -m toolkit grade labs/01-ring-allreduce [--solution my_ring.py]

A lab's checks.py is written with `check`, `Context` and `CheckFailed` (see `grading.checks`);
`grade` runs them (see `grading.grader`).
"""
from .checks import Check, CheckFailed, Context, Message, check, show
from .grader import CheckResult, Score, format_score, grade, grade_command, main

__all__ = ["Check", "CheckFailed", "CheckResult", "Context", "Message", "Score", "check", "format_score",
           "grade", "grade_command", "main", "show"]
