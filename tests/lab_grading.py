"""What every lab's grader test proves, written once: the untouched skeleton scores 0, the reference scores
full marks, a submission that hands the work to the toolkit's own implementation scores 0 and is told so,
and a classic mistake loses exactly the checks that describe it (so the checks can fail, and fail for the
right reason).

The reference is graded whole (`grade`: the delegation watch, the score); the classic mistakes, with the reference
and the skeleton beside them, are graded together (`LabGrading.grade_together`): as a grading grades a submission,
but every student in one launch per world size. A launch's ranks cost more than most labs' checks (a mistake graded
beside the reference costs well under a CPU second, graded alone 2-10), so one grading per mistake cost the suite a
minute of CPU.
"""

import secrets
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from toolkit.grading import CheckFailed, format_score, grade, lab_checks
from toolkit.grading.declared import declared
from toolkit.grading.grader import _generator
from toolkit.grading.isolation import Sandbox
from toolkit.grading.mutants import LIMITS, WRAPPER
from toolkit.grading.session import Box, launch_ranks
from toolkit.grading.verdicts import relayed
from toolkit.grading.verdicts import verdict as judge

LABS = Path(__file__).resolve().parent.parent / "labs"

# A submission's attack on its own copy of the inputs, at import: it finds the `given` dict in a calling frame (the
# rank's inputs for every check) and empties it. Before the contract, judges zipped the cases they drew with the
# answers, so an emptied list of cases judged nothing and passed.
EMPTY_THE_INPUTS = """

import sys as _sys

_frame = _sys._getframe(0)
while _frame is not None and not isinstance(_frame.f_locals.get("given"), dict):
    _frame = _frame.f_back
for _inputs in (_frame.f_locals["given"].values() if _frame is not None else ()):
    if isinstance(_inputs, list):            # [[case id, inputs], ...]
        _inputs.clear()
    elif isinstance(_inputs, dict):          # one dict of inputs per check (before the contract)
        for _value in _inputs.values():
            if isinstance(_value, (list, dict)):
                _value.clear()
"""


def check_named(lab, prefix: str):
    """The one check of `lab` (a folder) whose name starts with `prefix` (hidden checks included)."""
    (found,) = [c for c in lab_checks(lab)[0] if c.name.startswith(prefix)]
    return found


def verdict(check, n: int, answer, seed: int = 0) -> str:
    """What the grader says of `check` at world size n when rank r answers case c with `answer(r, c, given)` (given:
    the grader's copy of case c, one entry per rank): "" when it passes. No ranks run: the contract and the judge run
    here, on the cases the check draws with `seed`."""
    drawn = check.make_inputs(n, torch.Generator().manual_seed(seed))
    sent = [[[case, answer(r, case, drawn.given(case))] for case in drawn.ids] for r in range(n)]
    try:
        check.verdict(n, drawn, sent)
    except CheckFailed as failure:
        return str(failure)
    return ""


def grade_many(lab: Path, students: dict, seed: int) -> dict:
    """{student: {check name: its message at the first world size where it fails, or ""}} for every student (name:
    source) of `lab`, graded as a grading grades a submission (the sandbox, the students' build of the toolkit, the
    grader's relay, the inputs a grading with `seed` draws), every check of every student in one launch per world
    size (and another after a check that ended its launch, as a grading does), judged here by the lab's checks.
    What a grading adds around this (the delegation watch, the score) is proven by each lab's reference graded
    whole."""
    checks, _ = lab_checks(lab)
    names = list(students)
    found = {name: {check.name: "" for check in checks} for name in names}
    with tempfile.TemporaryDirectory(prefix="lab-many-") as tmp:
        shutil.copy(lab / "checks.py", Path(tmp) / "checks.py")  # its ANSWERS: the students' build the ranks import
        (Path(tmp) / "tasks.py").write_text(
            WRAPPER.format(
                tasks=(lab / "tasks.py").read_text(),
                tasks_file=str(lab / "tasks.py"),
                mutants={k: students[name] for k, name in enumerate(names)},
            )
        )
        with Sandbox() as marked, Box(Path(tmp), b"", "solution.py") as box:
            for n in sorted({n for check in checks for n in check.world_sizes}):
                judged = [i for i, check in enumerate(checks) if n in check.world_sizes]
                drawn = {i: checks[i].make_inputs(n, _generator(seed, checks[i], n)) for i in judged}
                virtual = {
                    k * len(checks) + i: replace(checks[i], task=f"m{k}__{checks[i].task}")
                    for k in range(len(names))
                    for i in judged
                }
                todo = list(virtual)
                while todo:
                    launch = launch_ranks(
                        box,
                        n,
                        todo,
                        {v: virtual[v].task for v in todo},
                        {v: drawn[v % len(checks)] for v in todo},
                        [],
                        LIMITS,
                        backend="gloo",
                        quiet=True,
                        grading_id=marked.id,
                        messages_only=bool(declared(lab, "MESSAGES_ONLY", False)),
                    )
                    assert launch.stuck is None, (f"seed {seed}", launch.stuck)  # every student here ends, no hang
                    for position, v in enumerate(todo):
                        results = relayed(launch.results.get(v, {}), launch, v)
                        said, name = found[names[v // len(checks)]], virtual[v].name
                        said[name] = said[name] or judge(virtual[v], n, drawn[v % len(checks)], results, launch)
                        if len(results) < n or v == launch.abandoned:  # the launch ended in this check
                            todo = todo[position + 1 :]
                            break
                    else:
                        todo = []
    return found


REFERENCE, SKELETON = "the reference", "the untouched skeleton"


@dataclass
class Graded:
    """Students graded together: {student: {check key: its message, or "" where it passed}}, and their inputs' seed."""

    seed: int
    said: dict


class LabGrading:
    def __init__(self, folder: str, maximum: int, checks: dict):
        self.lab = LABS / folder
        self.maximum = maximum
        self.checks = checks  # a short key -> the start of the check's name in checks.py

    def by_key(self, named: list) -> dict:
        """{key: the one item of `named` (results, or check names) whose name starts with the key's prefix}."""
        names = [getattr(item, "name", item) for item in named]
        results = {}
        for key, prefix in self.checks.items():
            found = [item for item, name in zip(named, names) if name.startswith(prefix)]
            assert len(found) == 1, f"no single check named {prefix!r}: {names}"
            results[key] = found[0]
        assert len(results) == len(named), "a check is missing from this test's list"
        return results

    def grade_together(self, mistakes: dict, seed: int | None = None) -> Graded:
        """The reference, the untouched skeleton and each mistake (name: (old, new), applied once to the reference)
        graded together (`grade_many`). seed: the inputs (default: drawn afresh, as for a student)."""
        reference = (self.lab / "solution.py").read_text()
        students = {REFERENCE: reference, SKELETON: (self.lab / "skeleton.py").read_text()}
        for name, (old, new) in mistakes.items():
            assert reference.count(old) == 1, f"{name}: the reference no longer contains {old!r}: update this test"
            students[name] = reference.replace(old, new)
        seed = secrets.randbits(62) if seed is None else seed
        said = grade_many(self.lab, students, seed)
        return Graded(
            seed,
            {name: {k: by_name[c] for k, c in self.by_key(list(by_name)).items()} for name, by_name in said.items()},
        )

    def assert_reference_passes_and_skeleton_fails(self, graded: Graded) -> None:
        """Graded together: the reference passes every check, the untouched skeleton fails every one, unimplemented."""
        assert not any(graded.said[REFERENCE].values()), (f"seed {graded.seed}", graded.said[REFERENCE])
        for key, message in graded.said[SKELETON].items():
            assert "not implemented yet" in message, (f"seed {graded.seed}", key, message)

    def assert_loses_exactly(self, graded: Graded, name: str, failing: dict) -> None:
        """Graded together, mistake `name` fails exactly the checks of `failing` (keys -> a phrase of their message,
        or a tuple of phrases, any of which may appear, where the inputs decide which comes first), and passes the
        others."""
        for key, said in graded.said[name].items():
            if key not in failing:
                assert said == "", f"{name}: check {key!r} should still pass (seed {graded.seed}): {said}"
                continue
            phrases = failing[key] if isinstance(failing[key], tuple) else (failing[key],)
            assert any(p in said for p in phrases), f"{name}: {key!r} says {said!r} (seed {graded.seed})"

    def assert_skeleton_scores_zero(self) -> None:
        score = grade(self.lab)
        assert score.maximum == self.maximum and score.total == 0, format_score(score)
        for result in score.results:
            assert "not implemented yet" in (result.detail or result.message), result

    def assert_reference_scores_full(self) -> None:
        score = grade(self.lab, self.lab / "solution.py")
        assert score.total == score.maximum == self.maximum, format_score(score)

    def assert_delegation_scores_zero(self, added: str, answer: str, tmp_path) -> None:
        """The reference with `added` (code that hands the work to the toolkit's `answer`, an entry of the lab's
        ANSWERS) scores 0, and every check says which answer it used."""
        assert answer in lab_checks(self.lab)[1], f"{answer} is not among the lab's ANSWERS"
        delegating = tmp_path / "delegating.py"
        delegating.write_text((self.lab / "solution.py").read_text() + "\n" + added + "\n")
        score = grade(self.lab, delegating)
        assert score.total == 0 and score.maximum == self.maximum, format_score(score)
        for result in score.results:
            said = result.detail or result.message
            assert answer.replace(":", ".") in said and "the toolkit's own implementation" in said, result

    def assert_attack_scores(self, attack: str, expected: int, tmp_path, whole: bool = False) -> None:
        """The skeleton with `attack` appended (or `attack` alone: whole=True) scores `expected` points."""
        attacking = tmp_path / "attacking.py"
        attacking.write_text(attack if whole else (self.lab / "skeleton.py").read_text() + attack)
        score = grade(self.lab, attacking)
        assert score.maximum == self.maximum and score.total == expected, format_score(score)

    def assert_mistake_loses_exactly(self, name: str, change: tuple, failing: dict, tmp_path, seed=None) -> None:
        """Apply `change` (old, new) to the reference once; `failing` maps check keys to a phrase of their message
        (or a tuple of phrases, any of which may appear, where the grading's random inputs decide which comes first).
        seed: the grading's inputs (default: drawn afresh, as for a student)."""
        reference = (self.lab / "solution.py").read_text()
        old, new = change
        assert reference.count(old) == 1, f"{name}: the reference no longer contains {old!r}: update this test"
        broken = tmp_path / "broken.py"
        broken.write_text(reference.replace(old, new))
        score = grade(self.lab, broken, seed=seed)
        results = self.by_key(score.results)
        for key, result in results.items():
            if key in failing:
                assert result.earned == 0, f"{name}: check {key!r} should fail\n{format_score(score)}"
                phrases = failing[key] if isinstance(failing[key], tuple) else (failing[key],)
                said = result.detail or result.message  # a hidden check: its own message, not the feedback
                assert any(p in said for p in phrases), f"{name}: {key!r} says {said!r}"
            else:
                assert result.passed, f"{name}: check {key!r} should still pass\n{format_score(score)}"
        assert score.total == self.maximum - sum(results[k].points for k in failing)
