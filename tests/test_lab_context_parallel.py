"""Lab 13 (ring attention's merge and pass) through the grader: the reference scores full marks, the untouched skeleton
0, a submission that hands the work to the toolkit's own ring attention 0 (and is told so), and each classic mistake
loses exactly the checks that name it, with a message that names it:

    the merge       no max subtracted (overflow at scores near 900), the exponent's sign reversed, the weights not
                    renormalised
    the rings       the diagonal block without the causal mask, an earlier block with it, the block in hand off by
                    one, the blocks sent to the previous rank, the last step missing; deadlocks named before anything
                    hangs (a blocking send, a receive waited for before the send is posted, and the other way round);
                    a wait before the block's attention (no overlap); a rank's own share of its own block sent round
                    too; a gradient that never comes home

The mistakes are graded together with the reference and the skeleton (tests/lab_grading.py); the skeleton's whole
grading is under `grading_scale` (make test-grading).
"""

import pytest
import torch
from lab_grading import LABS, LabGrading

from toolkit.grading import lab_checks

LAB = LABS / "13-context-parallel"
CHECKS = {
    "merge": "merge",
    "forward": "forward",
    "backward": "backward",
    "traffic forward": "traffic, forward",
    "traffic backward": "traffic, backward",
    "overlap": "overlap",
    "subgroups": "rings on subgroups",
}
RINGS = ("forward", "backward", "traffic forward", "traffic backward", "overlap", "subgroups")
PASS_ON = "[dist.isend(block, following, group), dist.irecv(incoming, previous, group)]"
FORWARD_PASS = (
    "# the next block travels while this one is attended\n"
    "            incoming, works = pass_on(kv, previous, following, group)\n"
)
RECEIVE_FIRST = (
    "    receive = dist.irecv(incoming, previous, group)\n    receive.wait()\n"
    "    return incoming, [dist.isend(block, following, group), receive]"
)
MISTAKES = {  # name: ((old, new) in the reference, {check: a phrase of its message})
    "no max subtracted": (
        ("    top = torch.maximum(lse1, lse2)", "    top = torch.zeros_like(lse1)"),
        {"merge": "nan or inf at scores this large"},
    ),
    "the exponent's sign reversed": (
        ("torch.exp(lse1 - top), torch.exp(lse2 - top)", "torch.exp(top - lse1), torch.exp(top - lse2)"),
        {
            "merge": "out1 is weighted by the second block's share",
            "forward": "is the merge right",
            "subgroups": "is the merge right",
        },
    ),
    "not renormalised": (
        (
            "out = (w1 / total).unsqueeze(-1) * out1 + (w2 / total).unsqueeze(-1) * out2",
            "out = w1.unsqueeze(-1) * out1 + w2.unsqueeze(-1) * out2",
        ),
        {"merge": "(not renormalised?)", "forward": "is the merge right", "subgroups": "is the merge right"},
    ),
    "the diagonal block unmasked": (
        ('return "causal" if owner == me else None', 'return "all" if owner == me else None'),
        {
            "forward": "its own block (the diagonal) without the causal mask. Likely: the diagonal block needs the "
            "causal mask",
            "backward": "dq is the gradient through its own block (the diagonal) without the causal mask",
            "subgroups": "without the causal mask",
        },
    ),
    "an earlier block masked": (
        (
            '    if not causal or owner < me:\n        return "all"\n    return "causal" if owner == me else None',
            '    if not causal:\n        return "all"\n    return "causal" if owner <= me else None',
        ),
        {
            "forward": "rank 0's block with the causal mask. Likely: the causal mask is for the diagonal block only",
            "backward": "rank 0's block with the causal mask",
            "subgroups": "rank 0's block with the causal mask",
        },
    ),
    "the block in hand off by one": (
        ("return (me - step) % n", "return (me - step - 1) % n"),
        {
            "forward": ("the owner of the block in hand is off by", "Likely: the owner"),
            "backward": "the owner of the block in hand is off by",
            "subgroups": "the owner of the block in hand",
        },
    ),
    "sent to the previous rank": (
        (PASS_ON, "[dist.isend(block, previous, group), dist.irecv(incoming, following, group)]"),
        {
            "forward": "the blocks go round the wrong way",
            "backward": "the blocks go round the wrong way",
            "traffic forward": "rank 0 sends to rank 2 and receives from rank 1: the blocks go round the wrong way",
            "traffic backward": "the blocks go round the wrong way",
            "subgroups": "the blocks go round the wrong way",
        },
    ),
    "the last step missing": (
        ("    out = lse = None\n    for step in range(n):", "    out = lse = None\n    for step in range(n - 1):"),
        {"forward": "Likely: the last step is missing", "subgroups": ("the last step is missing", "out is None")},
    ),
    "a blocking send": (
        (PASS_ON, "[dist.send(block, following, group), dist.irecv(incoming, previous, group)]"),
        {check: "dist.send to rank 1 blocks until that rank has posted the matching receive" for check in RINGS},
    ),
    "the receive waited for first": (
        ("    return incoming, " + PASS_ON, RECEIVE_FIRST),
        {check: "values have come from rank " for check in RINGS},
    ),
    "the send waited for first": (
        (
            "    return incoming, " + PASS_ON,
            "    send = dist.isend(block, following, group)\n    send.wait()\n"
            "    return incoming, [send, dist.irecv(incoming, previous, group)]",
        ),
        {check: "values it sent to rank " for check in RINGS},
    ),
    "waited before the attention": (
        (FORWARD_PASS, FORWARD_PASS + "            wait(works)\n"),
        {
            "overlap": "rank 0, forward: its send to rank 1, posted after 0 block(s) had been attended, was waited for "
            "before the next block's attention began"
        },
    ),
    "the own share sent round too": (
        (
            "        if step == 0:\n            home = share\n",
            "        if step == 0:\n            home = torch.zeros_like(share)\n"
            "            travelling = pass_on(share, previous, following, group)\n",
        ),
        {"traffic backward": "one block too many. A rank's share of its own block stays at home"},
    ),
    "the gradient never comes home": (
        (
            "        wait(travelling[1])\n        home += travelling[0]\n    return",
            "        wait(travelling[1])\n    return",
        ),
        {
            "backward": "dk and dv hold the shares of the queries of ranks [0] only; those of ranks [1] are missing",
            "subgroups": "dk and dv hold the shares",
        },
    ),
}


def lab() -> LabGrading:
    return LabGrading("13-context-parallel", 11, CHECKS)


@pytest.fixture(scope="module")
def graded():
    return lab().grade_together({name: change for name, (change, _) in MISTAKES.items()}, seed=0)


@pytest.mark.timeout(600)
def test_the_reference_passes_and_the_skeleton_fails_everything(graded, no_leftover_ranks):
    lab().assert_reference_passes_and_skeleton_fails(graded)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_each_classic_mistake_loses_exactly_its_checks_and_is_named(mistake, graded):
    lab().assert_loses_exactly(graded, mistake, MISTAKES[mistake][1])


@pytest.mark.timeout(300)
def test_reference_solution_scores_full_marks(no_leftover_ranks):
    lab().assert_reference_scores_full()


def test_the_toolkits_own_ring_attention_and_merge_score_zero(tmp_path):
    lab().assert_delegation_scores_zero(
        "from toolkit.parallel.context import merge  # noqa: F811", "toolkit.parallel.context.merge:merge", tmp_path
    )
    lab().assert_delegation_scores_zero(
        "from toolkit.parallel.context import Ring", "toolkit.parallel.context.ring:Ring", tmp_path
    )


@pytest.mark.grading_scale
@pytest.mark.timeout(300)
def test_untouched_skeleton_scores_zero(no_leftover_ranks):
    lab().assert_skeleton_scores_zero()


def test_the_merge_check_draws_overflowing_and_unseen_blocks():
    """The merge's cases hold what the classic mistakes trip on: scores whose e^ overflows in their dtype, and
    blocks a query did not see (lse -inf, output 0), every case's expected value finite."""
    (merge,) = [c for c in lab_checks(LAB)[0] if c.name.startswith("merge")]
    drawn = merge.make_inputs(2, torch.Generator().manual_seed(1))
    cases = {case: drawn.given(case)[0] for case in drawn.ids}
    overflow = {torch.float64: 709.8, torch.float32: 88.8}
    assert any(c["lse1"].max() > overflow[c["lse1"].dtype] for c in cases.values() if c["lse1"].dtype == torch.float64)
    assert any(c["lse1"].max() > overflow[c["lse1"].dtype] for c in cases.values() if c["lse1"].dtype == torch.float32)
    unseen = [c for c in cases.values() if torch.isinf(torch.cat([c["lse1"], c["lse2"]])).any()]
    assert len(unseen) == 2 and all(torch.isfinite(torch.logaddexp(c["lse1"], c["lse2"])).all() for c in unseen)
