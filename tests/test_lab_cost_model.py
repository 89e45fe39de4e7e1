"""Lab 10 (the cost model) through the grader: the untouched skeleton scores 0, the reference full marks,
and classic mistakes lose exactly the checks that describe them, with a message that names the mistake."""
import types

import pytest
from lab_grading import LabGrading

from toolkit.grading import CheckFailed, Context
from toolkit.grading.grader import load_module

CHECKS = {  # a short key -> the start of the check's name in checks.py
    "all_reduce": "all_reduce_time",
    "rs_ag": "reduce_scatter_time and all_gather_time",
    "hand": "step_time on six hand cases",
    "recorded": "step_time on steps recorded",
    "whole": "your whole model",
}
LAB = LabGrading("10-cost-model", 11, CHECKS)


@pytest.mark.timeout(120)
def test_untouched_skeleton_scores_zero(no_leftover_ranks):
    LAB.assert_skeleton_scores_zero()


@pytest.mark.timeout(120)
def test_reference_solution_scores_full_marks(no_leftover_ranks):
    LAB.assert_reference_scores_full()


@pytest.mark.timeout(120)
def test_collectives_that_run_at_once_lose_the_overlap_checks_and_are_named(tmp_path, no_leftover_ranks):
    """A collective that starts when issued, even while the previous one still holds the link."""
    LAB.assert_mistake_loses_exactly("collectives run at once", ("start = max(clock, link_free)", "start = clock"),
                                     {"hand": "you let collectives run at once", "recorded": "expected",
                                      "whole": "your model predicts"}, tmp_path)


def test_the_other_classic_mistakes_are_named_without_a_launch():
    """The diagnosis itself, on one rank in this process: each wrong formula gets its own sentence."""
    checks = load_module(LAB.lab / "checks.py", "lab10_checks")
    ctx = Context(0, 1, None)
    size, n, alpha, beta = 2 ** 20, 8, 1e-5, 1e-9
    wrong = {
        "you counted one half": lambda s, n, a, b: (n - 1) * (a + s / n * b),
        "you paid the latency once": lambda s, n, a, b: a + 2 * (n - 1) * s / n * b,
        "you sent the whole buffer at every step": lambda s, n, a, b: 2 * (n - 1) * (a + s * b),
    }
    for phrase, formula in wrong.items():
        with pytest.raises(CheckFailed, match=phrase):
            checks.expect_ring(ctx, formula, "all_reduce", size, n, alpha, beta)
    blocking = types.SimpleNamespace(step_time=lambda program, comp, comm: {
        "step": 9.0, "compute": 0.0, "exposed_comm": 0.0, "overlapped_comm": 0.0})
    program, compute, comm = checks.HAND["an asynchronous all-reduce, partly hidden by the compute issued after it"]
    with pytest.raises(CheckFailed, match="step = 9.0, expected 3"):
        checks.expect_step(ctx, blocking, program, lambda c: compute[c.label], lambda c: comm[c.id], "case")
    no_overlap = types.SimpleNamespace(step_time=lambda program, comp, comm: {
        "step": 3.4, "compute": 2.4, "exposed_comm": 1.0, "overlapped_comm": 0.0})
    with pytest.raises(CheckFailed, match="as if it blocked"):
        checks.expect_step(ctx, no_overlap, program, lambda c: compute[c.label], lambda c: comm[c.id], "case")
