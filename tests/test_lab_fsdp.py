"""Lab 03 (one FSDP unit) through the grader: the untouched skeleton scores 0, the reference full marks,
and each classic mistake loses exactly the points of the checks that describe it. The mistakes are graded
together with the reference and the skeleton (tests/lab_grading.py); the skeleton's own grading is under
`grading_scale` (make test-grading)."""

import pytest
from lab_grading import LabGrading

CHECKS = {  # a short key -> the start of the check's name in checks.py
    "unshard": "unshard:",
    "freed": "reshard frees",
    "trace": "per step, every unit",
    "bytes": "bytes on the wire",
    "grads": "after one backward",
    "parity": "parity with 'local'",
}
LAB = LabGrading("03-fsdp-unit", 11, CHECKS)


@pytest.mark.grading_scale  # graded together below, every check "not implemented yet"
@pytest.mark.timeout(300)
def test_untouched_skeleton_scores_zero(no_leftover_ranks):
    LAB.assert_skeleton_scores_zero()


@pytest.mark.timeout(300)
def test_reference_solution_scores_full_marks(no_leftover_ranks):
    LAB.assert_reference_scores_full()


# (name, what to change in the reference, checks that must fail, a phrase their message must contain)
MISTAKES = [
    (
        "reshard never frees the memory",
        ("        self.flat.data.untyped_storage().resize_(0)\n", ""),
        {"freed": "still holds"},
    ),
    (
        "reduce-scatter sums instead of averaging",
        ('op="avg", group=self.sharding.shard_group', 'op="sum", group=self.sharding.shard_group'),
        {"grads": "the ranks' gradients were summed, not averaged", "parity": "SGD steps"},
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


def test_the_toolkits_own_unit_scores_zero(tmp_path):
    LAB.assert_delegation_scores_zero(
        "MyUnit.unshard = FSDPUnit.unshard  # the toolkit's own, not yours",
        "toolkit.parallel.fsdp_unit:FSDPUnit.unshard",
        tmp_path,
    )
