"""Lab 12 (1F1B's action list) through the grader: the untouched skeleton scores 0, the reference full marks, a
submission that hands the work to the toolkit's own 1F1B scores 0 and is told so, and each classic mistake loses
exactly the checks that describe it, with feedback that names it.

    the warm-up counted from the wrong end (rank r runs r warm-up forwards): a deadlock, reported before anything
        runs (the whole grading takes one launch, seconds), with the stage and action where each rank waits
    GPipe's order (every forward first): right results, the same bubble, but m micro-batches held

Gradings of every world size (the reference, GPipe's order, which trains correctly) cost a minute of two cores
each: the second is behind `grading_scale` (`make test-grading`), as is the delegation that only the ranks see.
"""

import pytest
from lab_grading import LabGrading

CHECKS = {
    "complete": "every micro-batch",
    "warm-up": "warm-up",
    "memory": "memory",
    "deadlock": "no deadlock",
    "bubble": "the bubble",
    "real": "on real ranks",
}
WARMUP = "    warmup = min(pp - rank - 1, microbatches)\n"
WAITS = (
    "rank 0 waits at 0B0 (after 0F0) to receive the gradient of micro-batch 0 from stage 1 (rank 1)\n"
    "  rank 1 waits at 1F1 (after 1F0) to receive the activation of micro-batch 1 from stage 0 (rank 0)"
)
MISTAKES = {
    "warm-up from the wrong end": (
        (WARMUP, "    warmup = min(rank, microbatches)\n"),
        {
            "warm-up": "pp=2, microbatches=2, rank 0 runs FBFB (0F0 0B0 0F1 0B1); 1F1B's rank 0 runs 1 warm-up",
            "memory": "pp=2, microbatches=2: rank 1 holds 2 micro-batches' activations at once",
            "deadlock": "pp=2, microbatches=2: the pipeline schedule deadlocks: every rank with work left waits to "
            "receive a message that its sender sends only after something it is itself waiting for.\n  " + WAITS,
            "bubble": "the schedule deadlocks, so it has no bubble to measure",
            "real": "the toolkit's driver refused to run your lists at pp=2: the pipeline schedule deadlocks",
        },
    ),
    "GPipe's order": (
        (WARMUP, "    warmup = microbatches\n"),
        {
            "warm-up": "pp=2, microbatches=2, rank 1 runs FFBB (1F0 1F1 1B0 1B1); 1F1B's rank 1 runs 0 warm-up",
            "memory": "pp=2, microbatches=2: rank 1 holds 2 micro-batches' activations at once (forwards run whose "
            "backward has not); 1F1B holds at most pp - rank = 1",
        },
    ),
}
AT_SCALE = {"GPipe's order"}  # it trains correctly, so it is graded at every world size: a minute


def lab() -> LabGrading:
    return LabGrading("12-pipeline", 7, CHECKS)


@pytest.mark.timeout(300)
def test_untouched_skeleton_scores_zero(no_leftover_ranks):
    lab().assert_skeleton_scores_zero()


@pytest.mark.timeout(300)
def test_reference_solution_scores_full_marks(no_leftover_ranks):
    lab().assert_reference_scores_full()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "mistake", [pytest.param(m, marks=pytest.mark.grading_scale) if m in AT_SCALE else m for m in MISTAKES]
)
def test_the_classic_mistakes_are_named(mistake, tmp_path, no_leftover_ranks):
    change, failing = MISTAKES[mistake]
    lab().assert_mistake_loses_exactly(mistake, change, failing, tmp_path)


def test_the_toolkits_own_1f1b_scores_zero(tmp_path):
    lab().assert_delegation_scores_zero(
        "from toolkit.parallel.pipeline.schedules import one_f_one_b  # noqa: F811",
        "toolkit.parallel.pipeline.schedules:one_f_one_b",
        tmp_path,
    )


TAKEN_FROM_THE_TABLE = """
def one_f_one_b(pp, microbatches, rank, virtual_stages=1):  # noqa: F811 - no name of the answer in the source
    package = __import__("toolkit.parallel." + "pipeline", fromlist=["x"])
    return getattr(package, "SCHED" + "ULES")["1f1b"](pp, microbatches, rank)
"""


@pytest.mark.grading_scale  # one launch: only the ranks can see this call
@pytest.mark.timeout(300)
def test_the_toolkits_1f1b_taken_from_its_table_of_schedules_scores_zero(tmp_path, no_leftover_ranks):
    lab().assert_delegation_scores_zero(
        TAKEN_FROM_THE_TABLE, "toolkit.parallel.pipeline.schedules:one_f_one_b", tmp_path
    )
