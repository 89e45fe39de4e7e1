"""Lab 04 (MoE dispatch and combine) through the grader: the untouched skeleton scores 0, the reference full
marks, and two classic mistakes lose exactly the points of the checks that describe them."""
from pathlib import Path

import pytest

from toolkit.grading import format_score, grade

LAB = Path(__file__).resolve().parent.parent / "labs" / "04-moe-dispatch"
MAXIMUM = 13
CHECKS = {  # a short key -> the start of the check's name in checks.py
    "counts": "exchange_counts",
    "sort": "sort_by_destination",
    "all_to_all": "all_to_all",
    "experts": "compute_experts",
    "combine": "combine",
    "layer": "the layer equals the one-process reference",
    "skew": "extreme skew",
    "trace": "the trace",
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


@pytest.mark.timeout(150)
def test_reference_solution_scores_full_marks(no_leftover_ranks):
    score = grade(LAB, LAB / "solution.py")
    assert score.total == score.maximum == MAXIMUM, format_score(score)


# (name, what to change in the reference, {check that must fail: a phrase its message must contain})
MISTAKES = [
    ("splits not swapped in the all-to-all's backward",
     ("back = send_rows(grad, ctx.in_splits, ctx.out_splits,", "back = send_rows(grad, ctx.out_splits, ctx.in_splits,"),
     {"all_to_all": "split sizes must add up", "layer": "split sizes must add up", "skew": "split sizes",
      "trace": "split sizes"}),
    ("each answer weighted with the wrong choice's gate weight",
     ("routing.gate_weight.reshape(-1)[order]", "routing.gate_weight.reshape(-1)[order // routing.top_k]"),
     {"combine": "output: rank 0 got", "layer": "layer output", "skew": "layer output"}),
]


@pytest.mark.timeout(200)
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
