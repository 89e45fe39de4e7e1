"""toolkit.viz.expert_load on a hand-made Run: two ranks, two MoE layers, three forwards each.

The numbers are chosen so every panel can be checked by hand: rank 0 holds experts 0-1, rank 1
experts 2-3; layer "a" is skewed and drifts (expert 0, then 3, then 3 is busiest), layer "b" is flat.
"""

import pytest

from toolkit import viz
from toolkit.run import Run
from toolkit.viz.expert_load import load_rows, moe_layers

# per layer, per forward, per rank: (counts, kept, capacity)
LOADS = {
    "a": [
        [([6, 1, 1, 0], [3, 1, 1, 0], 3), ([4, 0, 0, 0], [3, 0, 0, 0], 3)],  # global [10, 1, 1, 0]
        [([1, 1, 1, 5], [1, 1, 1, 3], 3), ([0, 0, 1, 3], [0, 0, 1, 3], 3)],  # global [1, 1, 2, 8]
        [([2, 2, 2, 2], [2, 2, 2, 2], 3), ([0, 0, 0, 4], [0, 0, 0, 3], 3)],
    ],  # global [2, 2, 2, 6]
    "b": [[([2, 2, 2, 2], [2, 2, 2, 2], 3), ([1, 1, 1, 1], [1, 1, 1, 1], 3)]] * 3,
}


def _record(layer, rank, step, counts, kept, capacity):
    dropped = sum(counts) - sum(kept)
    mean = sum(counts) / len(counts)
    return {
        "name": f"moe/{layer}/load",
        "rank": rank,
        "step": step,
        "value": {
            "counts": counts,
            "kept": kept,
            "dropped": dropped,
            "capacity": capacity,
            "received": [0, 0],
            "first": 2 * rank,
            "max_over_mean": max(counts) / mean,
            "cv": 0.0,
            "call": step + 1,
        },
    }


@pytest.fixture
def run():
    metrics = [{"name": "loss", "rank": 0, "step": 0, "value": 3.0}]
    for step in range(3):
        for layer in ("a", "b"):
            for rank in (0, 1):
                metrics.append(_record(layer, rank, step, *LOADS[layer][step][rank]))
    return Run(config={}, events=[], samples=[], metrics=metrics, meta={"ranks": [0, 1], "world_size": 2})


def test_layers_and_rows_sum_the_ranks(run):
    assert moe_layers(run) == ["a", "b"]
    rows = load_rows(run, "a")
    assert [r["counts"] for r in rows] == [[10, 1, 1, 0], [1, 1, 2, 8], [2, 2, 2, 6]]
    assert [r["dropped"] for r in rows] == [4, 2, 1]
    assert [r["capacity"] for r in rows] == [6, 6, 6]
    assert rows[0]["owner"] == [0, 0, 1, 1]
    assert [r["max_over_mean"] for r in rows] == pytest.approx([10 / 3, 8 / 3, 2.0])


def test_heatmap_dropped_and_imbalance_panels(run):
    fig = viz.expert_load(run, "a")
    heat, dots, dropped, imbalance = fig.data
    assert heat.type == "heatmap" and list(heat.x) == [0, 1, 2] and list(heat.y) == [0, 1, 2, 3]
    # colour = load relative to balance: expert 0 took 10 of 12 choices over 4 experts at iteration 0
    assert heat.z[0][0] == pytest.approx(10 / 3) and heat.z[3][1] == pytest.approx(8 / 3) and heat.z[3][0] == 0
    assert heat.zmin == 0 and heat.zmax == pytest.approx(10 / 3)
    assert list(dots.y) == [0, 3, 3]  # the busiest expert drifts from 0 to 3
    assert list(dropped.y) == [4, 2, 1]
    assert list(imbalance.y) == pytest.approx([10 / 3, 8 / 3, 2.0])
    # the panels are stacked: heatmap and dots on top, drops in the middle, imbalance at the bottom
    assert (heat.yaxis, dots.yaxis, dropped.yaxis, imbalance.yaxis) == ("y", "y", "y2", "y3")
    hover = heat.hovertext[0][0]
    assert "expert 0</b> on rank 0" in hover and "routed 10 of 12" in hover and "kept 6" in hover
    assert "over capacity 4" in hover and "capacity 6" in hover and "step 0" in hover
    assert "expert 2</b> on rank 1" in heat.hovertext[2][1]
    title = fig.layout.title.text + " " + fig.layout.title.subtitle.text
    assert "'a'" in title and "4 experts" in title and "3.33" in title and "busiest expert changed 1 times" in title
    assert not fig.layout.updatemenus  # one layer asked for: no dropdown


def test_dropdown_switches_layers(run):
    fig = viz.expert_load(run)
    assert len(fig.data) == 8
    assert [t.visible for t in fig.data] == [True] * 4 + [False] * 4
    (menu,) = fig.layout.updatemenus
    assert [b.label for b in menu.buttons] == ["a", "b"]
    assert menu.buttons[1].args[0]["visible"] == [False] * 4 + [True] * 4
    assert (
        "'b'" in menu.buttons[1].args[1]["title.text"] and "experts" in menu.buttons[1].args[1]["title.subtitle.text"]
    )
    flat = fig.data[4]  # layer b: perfectly balanced, nothing dropped
    assert all(v == pytest.approx(1.0) for row in flat.z for v in row)
    assert list(fig.data[6].y) == [0, 0, 0] and list(fig.data[7].y) == pytest.approx([1.0] * 3)


def test_micro_batches_and_a_run_without_loads(run):
    # two forwards per step (gradient accumulation): iterations count forwards, hover names the micro-batch
    for m in run.metrics:
        if m["name"].startswith("moe/"):
            m["step"] = m["value"]["call"] // 2
    rows = load_rows(run, "a")
    assert [(r["step"], r["micro"]) for r in rows] == [(0, 0), (1, 0), (1, 1)]
    assert "step 1, micro-batch 1" in viz.expert_load(run, "a").data[0].hovertext[0][2]
    with pytest.raises(ValueError, match=r"choose one of \['a', 'b'\]"):
        viz.expert_load(run, "c")
    with pytest.raises(ValueError, match="no expert-load records"):
        viz.expert_load(Run(config={}, events=[], samples=[], metrics=[], meta={}))
