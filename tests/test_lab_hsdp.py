"""Lab 07 (hybrid sharding) through the grader, on 4 ranks seen as 2 nodes of 2: the untouched skeleton
scores 0, the reference full marks, and the classic mistake (no all-reduce across the replicas: each
node trains its own model) loses exactly the checks that describe it, with feedback that names it."""
import pytest
from lab_grading import LabGrading

CHECKS = {  # a short key -> the start of the check's name in checks.py
    "layout": "hsdp_layout",
    "groups": "make_groups",
    "grads": "after one backward",
    "parity": "parity",
    "bytes": "bytes across nodes",
}
LAB = LabGrading("07-hsdp", 8, CHECKS)


@pytest.mark.timeout(120)
def test_untouched_skeleton_scores_zero(no_leftover_ranks):
    LAB.assert_skeleton_scores_zero()


@pytest.mark.timeout(120)
def test_reference_solution_scores_full_marks(no_leftover_ranks):
    LAB.assert_reference_scores_full()


@pytest.mark.timeout(120)
def test_replicas_never_averaged_is_named(tmp_path, no_leftover_ranks):
    LAB.assert_mistake_loses_exactly(
        "no all-reduce across the replica group",
        ('        comm.all_reduce(out, op="avg", group=self.sharding.replica_group)\n', ""),
        {"grads": "the replicas were never averaged", "parity": "after 3 SGD steps",
         "bytes": "no byte crossed from node to node"},
        tmp_path)
