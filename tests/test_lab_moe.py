"""Lab 04 (MoE dispatch and combine) through the grader: the untouched skeleton scores 0, the reference full
marks, and two classic mistakes lose exactly the points of the checks that describe them. The mistakes are
graded together with the reference and the skeleton (tests/lab_grading.py); the skeleton's own grading is under
`grading_scale` (make test-grading)."""

import pytest
import torch
from lab_grading import LabGrading, check_named, verdict

CHECKS = {  # a short key -> the start of the check's name in checks.py
    "counts": "exchange_counts",
    "sort": "sort_by_destination",
    "all_to_all": "all_to_all",
    "experts": "compute_experts",
    "combine": "combine",
    "layer": "the layer equals the one-process reference",
    "skew": "extreme skew",
    "trace": "the trace",
}
LAB = LabGrading("04-moe-dispatch", 13, CHECKS)


@pytest.mark.grading_scale  # graded together below, every check "not implemented yet"
@pytest.mark.timeout(300)
def test_untouched_skeleton_scores_zero(no_leftover_ranks):
    LAB.assert_skeleton_scores_zero()


@pytest.mark.timeout(300)
def test_reference_solution_scores_full_marks(no_leftover_ranks):
    LAB.assert_reference_scores_full()


# (name, what to change in the reference, {check that must fail: a phrase its message must contain})
MISTAKES = [
    (
        "splits not swapped in the all-to-all's backward",
        (
            "back = send_rows(grad, ctx.in_splits, ctx.out_splits,",
            "back = send_rows(grad, ctx.out_splits, ctx.in_splits,",
        ),
        {
            "all_to_all": "split sizes must add up",
            "layer": "split sizes must add up",
            "skew": "split sizes",
            "trace": "split sizes",
        },
    ),
    (
        "each answer weighted with the wrong choice's gate weight",
        ("routing.gate_weight.reshape(-1)[order]", "routing.gate_weight.reshape(-1)[order // routing.top_k]"),
        {"combine": "output: rank 0 got", "layer": "layer output", "skew": "layer output"},
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


def test_the_toolkits_own_layer_scores_zero(tmp_path):
    LAB.assert_delegation_scores_zero(
        "LabMoE.forward = MoE.forward  # the toolkit's own, not yours", "toolkit.moe.layer:MoE.forward", tmp_path
    )


def test_the_trace_is_always_drawn_so_unswapped_splits_move_the_wrong_sizes():
    """Seed 3283981737566723443 (a clean clone's run) drew tokens where rank 0 sent rank 1 as many rows as it got
    back, so a backward that forgets to swap the splits carried the right sizes and kept the trace's point (about 1
    grading in 60). The trace's tokens are drawn until the exchange is asymmetric."""
    check = check_named(LAB.lab, "the trace")
    rows_to_each_rank = check.judge.__globals__["_rows_to_each_rank"]
    for seed in (3283981737566723443, *range(100)):
        drawn = check.make_inputs(2, torch.Generator().manual_seed(seed))
        rows = [rows_to_each_rank(2, rank["x"]) for rank in drawn.given(drawn.ids[0])]
        assert rows[0][1] != rows[1][0], (seed, rows)


def test_compute_experts_judges_a_rank_that_receives_no_rows():
    """About 1 grading in 500 draws a rank that receives no rows (seed 132543461849019322 did, in a clean clone's
    run): the check crashed building the expected answer (torch.stack of nothing) and said "your results could not
    be checked" to every student, the reference included. An empty answer is right there, and a row where none
    arrived is wrong."""
    check = check_named(LAB.lab, "compute_experts")

    def least_received(seed: int) -> int:
        drawn = check.make_inputs(2, torch.Generator().manual_seed(seed))
        return min(int(rank["recv"].sum()) for rank in drawn.given(drawn.ids[0]))

    seed = next(s for s in range(20_000) if least_received(s) == 0)
    lab = check.judge.__globals__  # the lab's own experts and constants
    Experts, D, FF, SEED, INIT = (lab[k] for k in ("Experts", "D", "FF", "SEED", "INIT"))  # noqa: N806

    def answer(r, case, given, extra_row=False):
        layer = Experts(D, FF, 6, 3 * r, 3, seed=SEED, init_std=INIT)
        recv, received = given[r]["recv"], given[r]["received"]
        order = [e for j in range(2) for e in range(3) for _ in range(int(recv[j, e]))]
        with torch.no_grad():
            out = [layer.expert(e, row[None])[0] for e, row in zip(order, received)]
        out = torch.stack(out) if out else received.new_zeros((0, D))
        return {"out": torch.cat([out, out.new_zeros((1, D))]) if extra_row and not len(received) else out}

    assert verdict(check, 2, answer, seed) == ""
    assert verdict(check, 2, lambda r, c, g: answer(r, c, g, extra_row=True), seed) != ""
