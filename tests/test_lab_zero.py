"""Lab 06 (ZeRO stage 2) through the grader: the untouched skeleton scores 0, the reference full marks,
and the classic mistake (no all-gather after the partitioned step) loses exactly the checks that
describe it, with feedback that names it."""
import pytest
from lab_grading import LabGrading

CHECKS = {  # a short key -> the start of the check's name in checks.py
    "bounds": "shard_bounds",
    "grads": "after one backward",
    "states": "the optimizer holds states",
    "parity": "parity",
    "bytes": "bytes per step",
}
LAB = LabGrading("06-zero", 8, CHECKS)


@pytest.mark.timeout(90)
def test_untouched_skeleton_scores_zero(no_leftover_ranks):
    LAB.assert_skeleton_scores_zero()


@pytest.mark.timeout(90)
def test_reference_solution_scores_full_marks(no_leftover_ranks):
    LAB.assert_reference_scores_full()


@pytest.mark.timeout(90)
def test_forgetting_the_all_gather_is_named(tmp_path, no_leftover_ranks):
    LAB.assert_mistake_loses_exactly(
        "no all-gather after the step",
        ("        comm.all_gather(self.flat.data, self.master.detach().clone(), group=self.group)\n", ""),
        {"parity": "only its own slice of the parameters changed", "bytes": "without the all-gather after the step"},
        tmp_path)
