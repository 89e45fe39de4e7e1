"""Lab 09 (Tutel's pipelined all-to-all) through the grader: the untouched skeleton scores 0, the reference
full marks, and the classic mistake (posting chunk k+1 only after computing chunk k: right numbers,
nothing overlapped) loses exactly the overlap check, with feedback that names it."""
import pytest
from lab_grading import LabGrading

CHECKS = {  # a short key -> the start of the check's name in checks.py
    "split": "split_capacity",
    "outputs": "outputs",
    "grads": "gradients",
    "overlap": "overlap on the trace",
    "traffic": "traffic",
    "hidden": "degree 4 on a capacity of 5",
}
LAB = LabGrading("09-tutel-pipeline", 9, CHECKS)  # 8 public points and 1 hidden (hidden_checks.py)


@pytest.mark.timeout(90)
def test_untouched_skeleton_scores_zero(no_leftover_ranks):
    LAB.assert_skeleton_scores_zero()


@pytest.mark.timeout(90)
def test_reference_solution_scores_full_marks(no_leftover_ranks):
    LAB.assert_reference_scores_full()


@pytest.mark.timeout(90)
def test_posting_the_next_chunk_too_late_is_named(tmp_path, no_leftover_ranks):
    LAB.assert_mistake_loses_exactly(
        "post chunk k+1 after computing chunk k",
        ("        following = exchange(chunks[k + 1], group, names[0], k + 1, count) if k + 1 < count else None\n"
         "        y = compute(k, pending.wait())\n",
         "        y = compute(k, pending.wait())\n"
         "        following = exchange(chunks[k + 1], group, names[0], k + 1, count) if k + 1 < count else None\n"),
        {"overlap": "was posted after chunk 1's experts had started"},
        tmp_path)
