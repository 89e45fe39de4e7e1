"""A grade: one result per check, decided in the grader's process, and the report a student reads."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .untrusted import clean


@dataclass
class CheckResult:
    name: str
    points: int
    earned: int
    message: str = ""  # why it failed, as the student may read it (empty when it passed)
    hidden: bool = False  # from the instructor's hidden_checks.py
    detail: str = ""  # a hidden check's own message: for the instructor's reports only, never the student's
    platform_only: bool = False  # a hidden check a students' copy names but cannot run: in no total

    @property
    def passed(self) -> bool:
        return not self.message


@dataclass
class Score:
    lab: str
    solution: str
    results: list[CheckResult] = field(default_factory=list)
    sandbox: str = ""  # the protections the submission ran under (sandbox.describe())

    @property
    def total(self) -> int:
        return sum(r.earned for r in self.results if not r.platform_only)

    @property
    def maximum(self) -> int:
        return sum(r.points for r in self.results if not r.platform_only)

    def __str__(self) -> str:
        return format_score(self)


def shown(score: Score) -> Score:
    """The score with every text a submission could have written (a message, its file's name) made unable to
    change the report's look (`untrusted.clean`): what every format of the report is made from."""
    return replace(
        score,
        lab=clean(score.lab),
        solution=clean(score.solution),
        sandbox=clean(score.sandbox),
        results=[
            replace(r, name=clean(r.name), message=clean(r.message), detail=clean(r.detail)) for r in score.results
        ],
    )


def format_score(score: Score) -> str:
    """A report a student reads top to bottom: each check, its points, and why it failed."""
    score = shown(score)
    lines = [f"Grading {score.solution}", f"  against {score.lab}/checks.py", ""]
    for r in score.results:
        if r.platform_only:
            lines += [f"  ---- [{r.points} on the platform] {r.name}", f"         {r.message}"]
            continue
        mark = "PASS" if r.passed else "FAIL"
        lines.append(f"  {mark} [{r.earned}/{r.points}] {r.name}")
        lines += [f"         {line}" for line in r.message.splitlines()]
    lines += ["", f"Score: {score.total}/{score.maximum}"]
    return "\n".join(lines)


def zero(score_lab: str, solution: str, checks, message: str) -> Score:
    """Every check failed with the same message (nothing could be graded, or the file cannot run)."""
    return Score(
        score_lab,
        solution,
        [
            CheckResult(
                c.name,
                c.points,
                0,
                message if not c.hidden else (c.feedback or message),
                c.hidden,
                message,
                platform_only=getattr(c, "platform_only", False),
            )
            for c in checks
        ],
    )
