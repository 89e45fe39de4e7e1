"""Lab 04 (MoE dispatch and combine) through the grader: the untouched skeleton scores 0, the reference full
marks, and two classic mistakes lose exactly the points of the checks that describe them. The mistakes are
graded together with the reference and the skeleton (tests/lab_grading.py); the skeleton's own grading is under
`grading_scale` (make test-grading)."""

import pytest
from lab_grading import LabGrading

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
LAB = LabGrading("04-moe-dispatch", 13, CHECKS)


@pytest.mark.grading_scale  # graded together below, every check "not implemented yet"
@pytest.mark.timeout(300)
def test_untouched_skeleton_scores_zero(no_leftover_ranks):
    LAB.assert_skeleton_scores_zero()


@pytest.mark.timeout(300)
def test_reference_solution_scores_full_marks(no_leftover_ranks):
    LAB.assert_reference_scores_full()


# (name, what to change in the reference, {check that must fail: a phrase its message must contain})
MISTAKES = [
    (
        "splits not swapped in the all-to-all's backward",
        (
            "back = send_rows(grad, ctx.in_splits, ctx.out_splits,",
            "back = send_rows(grad, ctx.out_splits, ctx.in_splits,",
        ),
        {
            "all_to_all": "split sizes must add up",
            "layer": "split sizes must add up",
            "skew": "split sizes",
            "trace": "split sizes",
        },
    ),
    (
        "each answer weighted with the wrong choice's gate weight",
        ("routing.gate_weight.reshape(-1)[order]", "routing.gate_weight.reshape(-1)[order // routing.top_k]"),
        {"combine": "output: rank 0 got", "layer": "layer output", "skew": "layer output"},
    ),
]


@pytest.fixture(scope="module")
def graded():
    return LAB.grade_together({name: change for name, change, _ in MISTAKES})


@pytest.mark.timeout(600)
def test_graded_together_the_reference_passes_and_the_skeleton_fails(graded, no_leftover_ranks):
    LAB.assert_reference_passes_and_skeleton_fails(graded)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name, change, failing", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_mistake_loses_exactly_its_checks(name, change, failing, graded, no_leftover_ranks):
    LAB.assert_loses_exactly(graded, name, failing)


def test_the_toolkits_own_layer_scores_zero(tmp_path):
    LAB.assert_delegation_scores_zero(
        "LabMoE.forward = MoE.forward  # the toolkit's own, not yours", "toolkit.moe.layer:MoE.forward", tmp_path
    )
