"""The pipeline's timeline figure drawn from a schedule's dry run: the textbook diagram, the formula's bubble."""

from __future__ import annotations

import pytest

from toolkit.parallel.pipeline import bubble, lowering, schedules
from toolkit.viz import pipeline_timeline, style


def ideal(name, p, m, v=1):
    actions = schedules.build(name, p, m, v)
    split = schedules.splits_backward(actions)
    return bubble.ideal_run(lowering.replay(lowering.lower(actions, p, tied=True), lowering.unit_cost(split, v)))


def test_the_dry_run_draws_the_classic_1f1b_diagram():
    fig = pipeline_timeline(ideal("1f1b", 4, 8), formula=bubble.formula_bubble("1f1b", 4, 8))
    forward, backward = (next(t for t in fig.data if t.name == n) for n in ("forward", "backward"))
    assert len(forward.x) == len(backward.x) == 4 * 8 and set(forward.x) == {1.0} and set(backward.x) == {2.0}
    rank0 = sorted((b, t) for b, t, y in zip(forward.base, forward.text, forward.y) if y.startswith("rank 0"))
    assert [t for _, t in rank0] == [f"F{i}" for i in range(8)]
    assert all(c == style.SEQUENCE[int(t[1:])] for c, t in zip(forward.marker.color, forward.text))
    assert len(fig.layout.annotations) == 2 * 8 * 3  # every activation and gradient between 4 stages
    subtitle = fig.layout.title.subtitle.text
    assert "rank 0 27%, rank 1 27%, rank 2 27%, rank 3 27%; the schedule's formula: 27%" in subtitle


def test_interleaved_rows_name_both_stages_of_a_rank():
    fig = pipeline_timeline(ideal("interleaved", 2, 4, 2))
    assert {y for t in fig.data for y in t.y} == {"rank 0 · stages 0, 2", "rank 1 · stages 1, 3"}


def test_a_run_without_pipeline_actions_is_refused_with_a_reason():
    from toolkit.run import Run

    with pytest.raises(ValueError, match="no pipeline actions"):
        pipeline_timeline(Run(config={}, events=[], meta={"ranks": [0]}))


def test_each_schedules_figure_names_its_schedule_and_shape():
    """Lesson 09 draws four schedules: each title says which (from the Run's config, or read off its actions)."""
    titles = {}
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)):
        told, read = ideal(name, 4, 8, v), ideal(name, 4, 8, v)
        told.config.update(schedule=name)
        titles[name] = pipeline_timeline(told).layout.title.text
        assert pipeline_timeline(read).layout.title.text == titles[name], name  # the same when read off the actions
    assert titles == {
        "gpipe": "GPipe, p = 4, m = 8 (dry run): one block per action",
        "1f1b": "1F1B, p = 4, m = 8 (dry run): one block per action",
        "interleaved": "Interleaved 1F1B, p = 4, m = 8, v = 2 (dry run): one block per action",
        "zb-h1": "ZB-H1, p = 4, m = 8 (dry run): one block per action",
    }
