"""Lab 02 (DDP gradient buckets) through the grader: the untouched skeleton scores 0, the reference full
marks, and each classic mistake loses exactly the points of the checks that describe it, so the
checks can fail, and fail for the right reason. The mistakes are graded together with the reference and the
skeleton (tests/lab_grading.py); the skeleton's own grading is under `grading_scale` (make test-grading)."""

import pytest
from lab_grading import LabGrading, check_named, verdict

from toolkit.grading import model_labs

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


def _traffic(n: int, twice_in: int | None) -> list:
    """What the relay records of 3 backwards of a DDP that all-reduces each gradient on its own (the check counts
    elements, not buckets), the last one a second time in backward `twice_in`."""
    calls = []
    for p in model_labs.parameters().values():
        size = p.numel() * p.element_size()
        calls.append({"name": "all_reduce", "args": {"numel": p.numel(), "bytes_sent": 2 * (n - 1) * size // n}})
    return [calls + calls[-1:] if step == twice_in else calls for step in range(1, 4)]


@pytest.mark.parametrize("twice_in", [1, 2, 3])
def test_the_traffic_check_sees_a_gradient_sent_twice_in_any_backward(twice_in):
    """A wrapper not put back as __init__ left it sends a bucket twice from the second backward on (the mutant
    `next_bucket = -1` in finish_backward), its gradients still right unless the two all-reduces race: the traffic
    check judges every backward of the loop, and says which one went wrong and what travelled in excess."""
    check, n = check_named(LAB.lab, "bytes on the wire"), 2
    assert verdict(check, n, lambda r, case, given: {"comms": _traffic(n, None)}) == ""
    said = verdict(check, n, lambda r, case, given: {"comms": _traffic(n, twice_in)})
    last = list(model_labs.parameters().values())[-1].numel()
    assert f"rank 0, backward {twice_in} of 3" in said and "some travelled more than once" in said, said
    if twice_in == 1:
        assert "right" not in said, said
    else:
        issued = len(model_labs.parameters())
        assert f"backward 1 issued {issued} (extra: all-reduces of [{last}] elements)" in said, said
        assert ("Backward 1 was right" if twice_in == 2 else "Backwards 1 to 2 were right") in said, said
