"""Lab 12 (1F1B's action list) through the grader: the untouched skeleton scores 0, the reference full marks,
and each classic mistake loses exactly the checks that describe it, with feedback that names it.

    GPipe's order (every forward first): right results, the bubble the same, but m micro-batches held
    the warm-up counted from the wrong end (rank r runs r warm-up forwards): a deadlock, reported before
    anything runs, with the stage and action where each rank waits
"""
import pytest
from lab_grading import LabGrading

CHECKS = {"complete": "every micro-batch", "warm-up": "warm-up", "memory": "memory", "deadlock": "no deadlock",
          "bubble": "the bubble", "real": "on real ranks"}
WARMUP = "    warmup = min(pp - rank - 1, microbatches)\n"
MISTAKES = {
    "GPipe's order": (
        (WARMUP, "    warmup = microbatches\n"),
        {"warm-up": "rank 1 runs FFBB (1F0 1F1 1B0 1B1); 1F1B's rank 1 runs 0 warm-up forward(s)",
         "memory": "rank 1 holds 2 micro-batches' activations at once (forwards run whose backward has not); 1F1B "
                   "holds at most pp - rank = 1"}),
    "warm-up from the wrong end": (
        (WARMUP, "    warmup = min(rank, microbatches)\n"),
        {"warm-up": "rank 0 runs FBFB",
         "memory": "rank 1 holds 2 micro-batches",
         "deadlock": "rank 0 waits at 0B0 (after 0F0) to receive the gradient of micro-batch 0 from stage 1 (rank 1)",
         "bubble": "the schedule deadlocks",
         "real": "the toolkit's driver refused to run your lists at pp=2: the pipeline schedule deadlocks"}),
}


def lab() -> LabGrading:
    return LabGrading("12-pipeline", 7, CHECKS)


@pytest.mark.timeout(240)
def test_untouched_skeleton_scores_zero(no_leftover_ranks):
    lab().assert_skeleton_scores_zero()


@pytest.mark.timeout(400)
def test_reference_solution_scores_full_marks(no_leftover_ranks):
    lab().assert_reference_scores_full()


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_the_classic_mistakes_are_named(mistake, tmp_path, no_leftover_ranks):
    change, failing = MISTAKES[mistake]
    lab().assert_mistake_loses_exactly(mistake, change, failing, tmp_path)
