"""Lab 02 (DDP gradient buckets) through the grader: the untouched skeleton scores 0, the reference full
marks, and each classic mistake loses exactly the points of the checks that describe it, so the
checks can fail, and fail for the right reason. The mistakes are graded together with the reference and the
skeleton (tests/lab_grading.py); the skeleton's own grading is under `grading_scale` (make test-grading)."""

import pytest
from lab_grading import LabGrading

CHECKS = {  # a short key -> the start of the check's name in checks.py
    "assign": "assign_buckets",
    "model_buckets": "a small cap on the tiny GPT",
    "grads": "after one backward",
    "parity": "parity with 'local'",
    "overlap": "overlap",
    "unused": "a parameter without a gradient",
    "bytes": "bytes on the wire",
}
LAB = LabGrading("02-ddp-buckets", 11, CHECKS)


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
        "buckets in forward order",
        ("for index in reversed(range(len(params))):", "for index in range(len(params)):"),
        {
            "assign": "reverse registration order",
            "model_buckets": "should start with 'ln_f.bias'",
            "overlap": "should already be travelling",
        },
    ),
    (
        "waiting for each bucket inside the hook",
        (
            "            self.next_bucket += 1\n",
            "            launch.handle.wait()\n            self.next_bucket += 1\n",
        ),
        {"overlap": "was waited for while backward was still running"},
    ),
    (
        "summing instead of averaging",
        ('op="avg", group=self.group, async_op=True', 'op="sum", group=self.group, async_op=True'),
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


def test_the_toolkits_own_ddp_scores_zero(tmp_path):
    LAB.assert_delegation_scores_zero(
        "from toolkit.parallel.ddp import assign_buckets  # noqa: F811", "toolkit.parallel.ddp", tmp_path
    )
