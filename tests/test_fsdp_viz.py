"""viz.memory.memory_over_time on hand-made Runs: a line per category, unit events marked, bounds drawn."""
import plotly.graph_objects as go
import pytest

from toolkit.run import Run
from toolkit.viz.memory import memory_over_time

UNIT = 1000  # bytes of a gathered unit in the made-up step


def _sample(rank, time, params, event=None, step=0, phase="forward", grads=0, activations=0):
    s = {"rank": rank, "time": time, "phase": phase, "step": step, "params": params, "grads": grads,
         "optimizer": 800, "activations": activations}
    if event:
        s["event"] = event
    return s


@pytest.fixture
def run():
    samples = []
    for rank in (0, 1):
        t = 10.0 + rank * 1e-4
        samples += [
            _sample(rank, t, 500 + UNIT, "gathered blocks.0"),
            _sample(rank, t + 0.001, 500 + 2 * UNIT, "prefetch blocks.1", activations=64),
            _sample(rank, t + 0.002, 500 + UNIT, "freed blocks.0", activations=128),
            _sample(rank, t + 0.003, 500, "freed blocks.1", activations=192),
            _sample(rank, t + 0.004, 500 + UNIT, "gathered blocks.1", phase="backward", grads=UNIT),
            _sample(rank, t + 0.005, 500, "reduce-scatter blocks.1", phase="backward", grads=UNIT // 2),
            _sample(rank, t + 0.006, 500, None, phase="optimizer", step=1),  # a phase-boundary sample
        ]
    return Run(config={}, events=[], samples=samples, metrics=[], meta={"ranks": [0, 1], "world_size": 2})


def _traces(fig, name):
    return [t for t in fig.data if t.name == name]


def test_a_line_per_category_and_rank(run):
    fig = memory_over_time(run, unit=1)
    assert isinstance(fig, go.Figure)
    for category in ("params", "grads", "optimizer", "activations", "total"):
        lines = _traces(fig, category)
        assert len(lines) == 2, category  # one per rank panel
        assert all(t.line.shape == "hv" for t in lines)
    params = _traces(fig, "params")[0]
    assert list(params.y) == [1500, 2500, 1500, 500, 1500, 500, 500]
    total = _traces(fig, "total")[0]
    assert total.y[1] == 500 + 2 * UNIT + 800 + 64  # params + grads + optimizer + activations
    assert params.x[0] == 0 and abs(params.x[-1] - 6) < 1e-6  # milliseconds since the first sample
    assert [a.text for a in fig.layout.annotations] == ["rank 0", "rank 1"]


def test_unit_events_are_marked_on_the_total(run):
    fig = memory_over_time(run, rank=1, unit=1)
    assert len(_traces(fig, "params")) == 1
    gathered = _traces(fig, "gathered")[0]
    assert list(gathered.text) == ["gathered blocks.0", "gathered blocks.1"]
    assert gathered.marker.symbol == "triangle-up"
    assert list(_traces(fig, "freed")[0].text) == ["freed blocks.0", "freed blocks.1"]
    assert list(_traces(fig, "prefetch")[0].text) == ["prefetch blocks.1"]
    assert list(_traces(fig, "reduce-scatter")[0].text) == ["reduce-scatter blocks.1"]
    total = _traces(fig, "total")[0]
    assert gathered.y[0] == total.y[0]
    assert "gathered blocks.0" in total.customdata[0]  # the hover of the line names the event too


def test_step_filter_bound_and_categories(run):
    fig = memory_over_time(run, rank=0, step=0, categories=("params",), bound={0: 2600}, bound_label="paper", unit=1)
    assert [t.name for t in fig.data if t.mode == "lines"] == ["params", "paper"]
    assert len(_traces(fig, "params")[0].y) == 6  # the step-1 sample is left out
    assert list(_traces(fig, "paper")[0].y) == [2600, 2600]
    assert _traces(fig, "gathered")[0].y[0] == 1500  # without a total line, events sit on the first category


def test_samples_without_events_and_bad_input():
    plain = Run(config={}, events=[], samples=[_sample(0, 1.0, 10), _sample(0, 2.0, 20)], metrics=[],
                meta={"ranks": [0]})
    fig = memory_over_time(plain)
    assert {t.name for t in fig.data} == {"params", "grads", "optimizer", "activations", "total"}
    with pytest.raises(ValueError, match="no memory samples"):
        memory_over_time(plain, step=5)
    with pytest.raises(ValueError, match="unknown categories"):
        memory_over_time(plain, categories=("weights",))
