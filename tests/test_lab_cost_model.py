"""Lab 10 (the cost model) through the grader: the untouched skeleton scores 0, the reference full marks,
and classic mistakes lose exactly the checks that describe them, with a message that names the mistake."""
import pytest
from lab_grading import LabGrading

CHECKS = {  # a short key -> the start of the check's name in checks.py
    "all_reduce": "all_reduce_time",
    "rs_ag": "reduce_scatter_time and all_gather_time",
    "hand": "step_time on six hand cases",
    "recorded": "step_time on steps recorded",
    "whole": "your whole model",
}
LAB = LabGrading("10-cost-model", 11, CHECKS)


@pytest.mark.timeout(120)
def test_untouched_skeleton_scores_zero(no_leftover_ranks):
    LAB.assert_skeleton_scores_zero()


@pytest.mark.timeout(120)
def test_reference_solution_scores_full_marks(no_leftover_ranks):
    LAB.assert_reference_scores_full()


# (name, what to change in the reference, {check that must fail: a phrase its message must contain})
MISTAKES = [
    # the all-reduce forgets its all-gather half
    ("all-reduce is only a reduce-scatter",
     ("return reduce_scatter_time(size_bytes, n, alpha, beta) + all_gather_time(size_bytes, n, alpha, beta)",
      "return reduce_scatter_time(size_bytes, n, alpha, beta)"),
     {"all_reduce": "you counted one half", "whole": "your model predicts"}),
    # a collective starts when issued, even while the previous one still holds the link
    ("collectives run at once",
     ("start = max(clock, link_free)", "start = clock"),
     {"hand": "you let collectives run at once", "recorded": "expected", "whole": "your model predicts"}),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, change, failing", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_mistake_loses_exactly_its_checks(name, change, failing, tmp_path, no_leftover_ranks):
    LAB.assert_mistake_loses_exactly(name, change, failing, tmp_path)
