"""Lab 05 (expert shadowing) through the grader: the untouched skeleton scores 0, the reference full marks,
and two classic mistakes in Algorithm 1 lose the checks that describe them (and keep the others)."""
from pathlib import Path

import pytest

from toolkit.grading import format_score, grade

LAB = Path(__file__).resolve().parent.parent / "labs" / "05-shadowing"
MAXIMUM = 11
CHECKS = {  # a short key -> the start of the check's name in checks.py
    "loads": "worker_loads",
    "model": "the latency model",
    "algorithm": "choose_shadows",
    "real": "on a real layer's counts",
    "equal": "the layer that shadows your choice",
    "gain": "a measured gain",
}


def by_key(score):
    results = {}
    for key, prefix in CHECKS.items():
        found = [r for r in score.results if r.name.startswith(prefix)]
        assert len(found) == 1, f"no single check named {prefix!r}: {[r.name for r in score.results]}"
        results[key] = found[0]
    assert len(results) == len(score.results)
    return results


@pytest.mark.timeout(120)
def test_untouched_skeleton_scores_zero(no_leftover_ranks):
    score = grade(LAB)
    assert score.maximum == MAXIMUM and score.total == 0, format_score(score)
    for result in score.results:
        assert "not implemented yet" in result.message, result


@pytest.mark.timeout(120)
def test_reference_solution_scores_full_marks(no_leftover_ranks):
    score = grade(LAB, LAB / "solution.py")
    assert score.total == score.maximum == MAXIMUM, format_score(score)


# (name, what to change in the reference, {check that must fail: a phrase its message must contain})
MISTAKES = [
    # the lightest experts first: on the strongly skewed layer it shadows an idle expert and nothing gets faster
    ("tries the experts lightest first",
     ("key=lambda e: (-load[e], e)", "key=lambda e: (load[e], e)"),
     {"algorithm": "expected", "real": "Algorithm 1 chooses", "gain": "below 0.8 expected"}),
    # every expert is compared with the plain layer instead of the best set so far: it never stops in time
    ("compares with Lat_imbl, not with the best so far",
     ("        best = latency\n", ""),
     {"algorithm": "Algorithm 1 on this case", "real": "Algorithm 1 chooses"}),
]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name, change, failing", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_classic_mistake_loses_exactly_its_checks(name, change, failing, tmp_path, no_leftover_ranks):
    reference = (LAB / "solution.py").read_text()
    wrong = reference.replace(*change)
    assert wrong != reference, f"{name}: the change no longer applies to solution.py"
    (tmp_path / "wrong.py").write_text(wrong)
    results = by_key(grade(LAB, tmp_path / "wrong.py"))
    for key, result in results.items():
        if key in failing:
            assert not result.passed and result.earned == 0, f"{name}: {key} should fail"
            assert failing[key] in result.message, f"{name}: {key}: {result.message}"
        else:
            assert result.passed, f"{name}: {key} should still pass: {result.message}"
