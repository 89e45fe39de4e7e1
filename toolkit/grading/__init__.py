"""The autograder for labs/: a submission is untrusted code; it runs in processes of its own, and only the
grader's side decides and writes a result.

    python -m toolkit grade labs/01-ring-allreduce [--solution my_ring.py] [--format text|json|gradescope]
    python -m toolkit grade labs/01-ring-allreduce --class submissions/ --csv scores.csv
    python -m toolkit release labs/ --out student-labs/ [--wheel]

A lab's `checks.py` is written with `check`, `Judge` and `CheckFailed` (`grading.checks`) and declares what its
tasks return with `like`, `Tensor`, `List`, ... (`grading.specs`; `grading.contract` holds every case to one
well-formed answer before any judge runs); its `tasks.py` is written with `on_rank.Rank`. `grade`
(`grading.grader`) runs the tasks next to the student's code in a sandbox (`box`, `session`, `runner`, `sandbox` with
`namespaces`, `landlock` and `seccomp`, `watchdog`, `isolation`), the ranks importing the students' toolkit
(`student_wheel.for_lab`), watched from outside (`overseer`: time, output, processes); a lab of point-to-point
messages talks through the grader's `relay` (`relay_group` on the ranks). It reads back what they observed (`wire`, and
every file through `untrusted`) and judges it (`verdicts`; `model_labs`: the tiny-GPT labs' inputs and reference);
`delegation` spots a submission that calls the toolkit's own answer; `report` turns a score into text, JSON or
Gradescope's results.json (every text made harmless first); `classroom` grades a folder of submissions; `release`
makes the students' copy of labs/ and `student_wheel` the toolkit without the labs' answers; `mutation` and
`mutants` grade each lab's reference mutants with its checks (make test-mutants).
"""

from .checks import Check, CheckFailed, Judge, check, number, seconds, show, sibling
from .cli import class_command, grade_command, main
from .contract import ContractBroken
from .grader import grade, lab_checks
from .limits import Limits
from .score import CheckResult, Score, format_score
from .specs import Either, Fields, Items, Keys, List, Maybe, Tensor, like

__all__ = [
    "Check",
    "CheckFailed",
    "CheckResult",
    "ContractBroken",
    "Either",
    "Fields",
    "Items",
    "Judge",
    "Keys",
    "Limits",
    "List",
    "Maybe",
    "Score",
    "Tensor",
    "check",
    "class_command",
    "format_score",
    "grade",
    "grade_command",
    "lab_checks",
    "like",
    "main",
    "number",
    "seconds",
    "show",
    "sibling",
]
