"""The schedules as data: their dry runs give the textbook bubbles and memory, and a wrong order is a deadlock
named before anything runs. No processes: `toolkit.parallel.pipeline.lowering.replay` steps every rank's
program on a clock (F = 1, B = 2; split: F = B = W = 1)."""

from __future__ import annotations

import pytest

from toolkit.parallel.pipeline import bubble, lowering, schedules
from toolkit.parallel.pipeline.schedules import Action

GRID = [(p, m) for p in (2, 3, 4) for m in (p, 2 * p, 4 * p)]
SINGLE = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1)]


def dry_run(name, p, m, v=1, tied=True):
    actions = schedules.build(name, p, m, v)
    timeline = lowering.replay(
        lowering.lower(actions, p, tied=tied), lowering.unit_cost(schedules.splits_backward(actions), v)
    )
    return actions, timeline


@pytest.mark.parametrize("name, v", SINGLE + [("interleaved", 2), ("interleaved", 4)])
@pytest.mark.parametrize("p, m", GRID)
def test_dry_run_bubble_is_the_formula(name, v, p, m):
    """(p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(vm+p-1) interleaved, (p-1)(F+B-W)/(m(F+B+W)+...) for ZB-H1:
    exactly, on every rank, with the tied embedding's two messages in the programs."""
    _, timeline = dry_run(name, p, m, v)
    busy, span = lowering.busy_and_span(timeline)
    for idle in (1 - b / span for b in busy):
        assert idle == pytest.approx(bubble.formula_bubble(name, p, m, v), abs=1e-12)


def test_interleaving_halves_and_zero_bubble_thirds_1f1b_idle_time():
    """1F1B idles 3(p-1) units per step (a stage's forward is 1); interleaved at v stages per rank (each 1/v of
    the layers) 3(p-1)/v (Narayanan et al.); ZB-H1 at F = B = W (p-1) (Qi et al.)."""
    for p, m in GRID:
        idle = [
            lowering.busy_and_span(dry_run(n, p, m, v)[1])[1] - 3 * m
            for n, v in (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))
        ]
        assert idle == [3 * (p - 1), 1.5 * (p - 1), p - 1]


@pytest.mark.parametrize("name, v", SINGLE + [("interleaved", 2)])
@pytest.mark.parametrize("p, m", GRID)
def test_micro_batches_in_flight_are_the_formula(name, v, p, m):
    """GPipe holds m on every rank; 1F1B p - r; ZB-H1 p until W; interleaved Megatron's warm-up + 1."""
    actions = schedules.build(name, p, m, v)
    assert [bubble.in_flight(a) for a in actions] == [bubble.formula_in_flight(name, p, m, r, v) for r in range(p)]


@pytest.mark.parametrize("p, v", [(2, 2), (3, 2), (4, 2), (4, 3)])
def test_interleaving_takes_any_number_of_micro_batches_from_pp_on(p, v):
    """Megatron-core's groups: m not a multiple of p runs too, its dry run the formula (p-1)/(vm+p-1) exactly on
    every rank, its activations Megatron's warm-up + 1 with the group's size; at multiples of p, groups of p."""
    for m in range(p, 3 * p + 2):
        actions, timeline = dry_run("interleaved", p, m, v)
        busy, span = lowering.busy_and_span(timeline)
        assert [1 - b / span for b in busy] == [
            pytest.approx(bubble.formula_bubble("interleaved", p, m, v), abs=1e-12)
        ] * p, m
        assert [bubble.in_flight(a) for a in actions] == [
            bubble.formula_in_flight("interleaved", p, m, r, v) for r in range(p)
        ], m
        assert schedules.group_size(p, m) == (
            p if m % p == 0 else min(g for g in range(p + 1, m + 1) if m % g == 0 or m % g >= p)
        )


def test_interleaved_order_is_megatron_cores_table():
    """Megatron-core's own example (schedules.py, `get_schedule_table`): pp 2, 5 micro-batches in groups of 3, two
    chunks: micro-batches 0 1 2 0 1 2 3 4 3 4 on chunks 0 0 0 1 1 1 0 0 1 1, read off rank 0's forwards."""
    assert schedules.group_size(2, 5) == 3
    forwards = [a for a in schedules.interleaved(2, 5, 0, 2) if a.kind == "F"]
    assert [a.micro for a in forwards] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [a.stage // 2 for a in forwards] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


def test_1f1b_reads_as_warm_up_steady_state_cool_down():
    assert schedules.show(schedules.build("1f1b", 3, 4)) == (
        "rank 0: 0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3\n"
        "rank 1: 1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3\n"
        "rank 2: 2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3"
    )


def test_a_wrong_order_is_a_deadlock_that_names_where_each_rank_waits():
    """Stage 0 waits for micro-batch 0's gradient before it sends micro-batch 1 forward, while stage 1 (in
    GPipe's order) waits for micro-batch 1 before it goes backward: each rank is told where it waits."""
    bad = [[Action("B", 0, 0), Action("F", 0, 0)], schedules.gpipe(2, 1, 1)]
    with pytest.raises(ValueError, match="comes before its forward"):
        schedules.check(bad, 2, 1)
    bad = [[Action("F", 0, 0), Action("B", 0, 0), Action("F", 1, 0), Action("B", 1, 0)], schedules.gpipe(2, 2, 1)]
    schedules.check(bad, 2, 2)  # each rank's list is complete and ordered: only running it shows the problem
    with pytest.raises(lowering.PipelineDeadlock) as caught:
        lowering.replay(lowering.lower(bad, 2), lowering.unit_cost(False))
    text = str(caught.value)
    assert "rank 0 waits at 0B0 (after 0F0) to receive the gradient of micro-batch 0 from stage 1 (rank 1)" in text
    assert "rank 1 waits at 1F1 (after 1F0) to receive the activation of micro-batch 1 from stage 0 (rank 0)" in text


@pytest.mark.parametrize(
    "bad, message",
    [
        ([[Action("F", 0, 0)], schedules.gpipe(2, 1, 1)], "never runs"),
        ([[Action("F", 0, 0), Action("F", 0, 0), Action("B", 0, 0)], schedules.gpipe(2, 1, 1)], "appears twice"),
        ([[Action("F", 0, 1), Action("B", 0, 1)], schedules.gpipe(2, 1, 1)], "holds stage"),
        ([[Action("X", 0, 0)], schedules.gpipe(2, 1, 1)], "kind must be one of"),
    ],
)
def test_a_malformed_schedule_is_refused_with_the_rank_and_action(bad, message):
    with pytest.raises(ValueError, match=message):
        schedules.check(bad, 2, 1)


def test_unknown_schedules_and_virtual_stages_are_explained():
    with pytest.raises(ValueError, match=r"unknown pipeline schedule 'pipedream'.*1f1b"):
        schedules.resolve("pipedream", 1)
    with pytest.raises(ValueError, match="virtual_stages=2 or more"):
        schedules.resolve("interleaved", 1)
    with pytest.raises(ValueError, match="needs schedule='interleaved'"):
        schedules.resolve("1f1b", 2)


def test_the_ideal_run_draws_like_a_measured_one():
    """The dry run as a Run: its measured bubble is the formula, read by the same function as a real Run's."""
    _, timeline = dry_run("1f1b", 4, 8)
    run = bubble.ideal_run(timeline)
    assert list(bubble.measured_bubble(run).values()) == [pytest.approx(3 / 11)] * 4
    assert sum(e["name"] == "send" for e in run.events) == 2 * 8 * 3 + 2  # activations, gradients, tied pair
