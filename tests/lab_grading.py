"""What every lab's grader test proves, written once: the untouched skeleton scores 0, the reference scores
full marks, a submission that hands the work to the toolkit's own implementation scores 0 and is told so,
and a classic mistake loses exactly the checks that describe it (so the checks can fail, and fail for the
right reason)."""

from pathlib import Path

import torch

from toolkit.grading import CheckFailed, format_score, grade, lab_checks

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


class LabGrading:
    def __init__(self, folder: str, maximum: int, checks: dict):
        self.lab = LABS / folder
        self.maximum = maximum
        self.checks = checks  # a short key -> the start of the check's name in checks.py

    def by_key(self, score) -> dict:
        results = {}
        for key, prefix in self.checks.items():
            found = [r for r in score.results if r.name.startswith(prefix)]
            assert len(found) == 1, f"no single check named {prefix!r}: {[r.name for r in score.results]}"
            results[key] = found[0]
        assert len(results) == len(score.results), "a check is missing from this test's list"
        return results

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
        results = self.by_key(score)
        for key, result in results.items():
            if key in failing:
                assert result.earned == 0, f"{name}: check {key!r} should fail\n{format_score(score)}"
                phrases = failing[key] if isinstance(failing[key], tuple) else (failing[key],)
                said = result.detail or result.message  # a hidden check: its own message, not the feedback
                assert any(p in said for p in phrases), f"{name}: {key!r} says {said!r}"
            else:
                assert result.passed, f"{name}: check {key!r} should still pass\n{format_score(score)}"
        assert score.total == self.maximum - sum(results[k].points for k in failing)
