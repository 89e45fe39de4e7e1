"""Lab 05 (expert shadowing) through the grader: the untouched skeleton scores 0, the reference full marks,
two classic mistakes in Algorithm 1 lose the checks that describe them (and keep the others), and the
toolkit's own rule scores 0. The released checks judge the latency model and the greedy by properties; the
hidden checks compare them with the toolkit's own on cases drawn for the grading. The mistakes are graded
together with the reference and the skeleton (tests/lab_grading.py); the skeleton's own grading is under
`grading_scale` (make test-grading)."""

import pytest
from lab_grading import LabGrading

CHECKS = {  # a short key -> the start of the check's name in checks.py
    "loads": "worker_loads:",
    "model": "the latency model",
    "algorithm": "choose_shadows:",
    "real": "on a real layer's counts: a valid choice",
    "equal": "the layer that shadows your choice",
    "gain": "a measured gain",
    "values": "worker_loads and the latency model",
    "choice": "choose_shadows on cases drawn",
    "real_choice": "on a real layer's counts (skewed",
}
LAB = LabGrading("05-shadowing", 12, CHECKS)  # 8 public points, 4 hidden


@pytest.mark.grading_scale  # graded together below, every check "not implemented yet"
@pytest.mark.timeout(300)
def test_untouched_skeleton_scores_zero(no_leftover_ranks):
    LAB.assert_skeleton_scores_zero()


@pytest.mark.timeout(300)
def test_reference_solution_scores_full_marks(no_leftover_ranks):
    LAB.assert_reference_scores_full()


# (name, what to change in the reference, {check that must fail: a phrase its message must contain}); the grading's
# inputs are drawn from a fixed seed, so the cases each mistake meets are the same every run
MISTAKES = [
    # the lightest experts first: on the strongly skewed layer it shadows an idle expert and nothing gets faster
    (
        "tries the experts lightest first",
        ("key=lambda e: (-load[e], e)", "key=lambda e: (load[e], e)"),
        {
            "algorithm": "the first candidate tried is the heaviest",
            "choice": "Algorithm 1 chooses",
            "real_choice": "Algorithm 1 chooses",
            "gain": "below 0.8 expected",
        },
    ),
    # every expert is compared with the plain layer instead of the best set so far: it never stops in time
    (
        "compares with Lat_imbl, not with the best so far",
        ("        best = latency\n", ""),
        {
            "algorithm": "lowers the latency below the best so far",
            "choice": "Algorithm 1 chooses",
            "real_choice": "Algorithm 1 chooses",
        },
    ),
]


@pytest.fixture(scope="module")
def graded():
    return LAB.grade_together({name: change for name, change, _ in MISTAKES}, seed=5)


@pytest.mark.timeout(600)
def test_graded_together_the_reference_passes_and_the_skeleton_fails(graded, no_leftover_ranks):
    LAB.assert_reference_passes_and_skeleton_fails(graded)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name, change, failing", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_mistake_loses_exactly_its_checks(name, change, failing, graded, no_leftover_ranks):
    LAB.assert_loses_exactly(graded, name, failing)


def test_the_toolkits_own_rule_scores_zero(tmp_path):
    LAB.assert_delegation_scores_zero(
        "from toolkit.moe.shadow import choose_shadows  # noqa: F811", "toolkit.moe.shadow:choose_shadows", tmp_path
    )
