"""viz.memory.memory_over_time on hand-made Runs: a line per category, unit events marked, bounds drawn."""

import plotly.graph_objects as go
import pytest

from toolkit.run import Run
from toolkit.viz.memory import memory_over_time

UNIT = 1000  # bytes of a gathered unit in the made-up step


def _sample(rank, time, params, event=None, step=0, phase="forward", grads=0, activations=0):
    s = {
        "rank": rank,
        "time": time,
        "phase": phase,
        "step": step,
        "params": params,
        "grads": grads,
        "optimizer": 800,
        "activations": activations,
    }
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


def test_model_states_line_carries_the_events_without_a_total(run):
    fig = memory_over_time(run, rank=0, categories=("params", "states"), unit=1)
    states = _traces(fig, "states")[0]
    assert states.y[4] == 500 + UNIT + UNIT + 800  # params + grads + optimizer, no activations
    assert list(_traces(fig, "gathered")[0].y) == [states.y[0], states.y[4]]


def test_step_filter_bound_and_categories(run):
    fig = memory_over_time(run, rank=0, step=0, categories=("params",), bound={0: 2600}, bound_label="paper", unit=1)
    assert [t.name for t in fig.data if t.mode == "lines"] == ["params", "paper"]
    assert len(_traces(fig, "params")[0].y) == 6  # the step-1 sample is left out
    assert list(_traces(fig, "paper")[0].y) == [2600, 2600]
    assert _traces(fig, "gathered")[0].y[0] == 1500  # without a total line, events sit on the first category


def test_samples_without_events_and_bad_input():
    plain = Run(
        config={}, events=[], samples=[_sample(0, 1.0, 10), _sample(0, 2.0, 20)], metrics=[], meta={"ranks": [0]}
    )
    fig = memory_over_time(plain)
    assert {t.name for t in fig.data} == {"params", "grads", "optimizer", "activations", "total"}  # the default
    with pytest.raises(ValueError, match="no memory samples"):
        memory_over_time(plain, step=5)
    with pytest.raises(ValueError, match="unknown categories"):
        memory_over_time(plain, categories=("weights",))


# --- the wrap-policy explorer ------------------------------------------------------------------------------
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from toolkit.models import tiny_gpt  # noqa: E402
from toolkit.parallel.fsdp_policy import plan  # noqa: E402
from toolkit.viz.fsdp_explorer import WHOLE_MODEL, policy_numbers, wrap_policy_explorer  # noqa: E402

SHAPE = dict(n_layer=4, d_model=64, n_head=4)  # notebook 04's model: root 6,272 + 4 blocks of 49,984
ROOT, BLOCK = 6272, 49984


def test_units_are_fsdps_own():
    model = tiny_gpt(**SHAPE)
    n = policy_numbers(model, None, 3)
    assert [u["unit"] for u in n["units"]] == ["(root)", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert [u["numel"] for u in n["units"]] == [ROOT] + [BLOCK] * 4
    assert [u["padding"] for u in n["units"]] == [(-ROOT) % 3] + [(-BLOCK) % 3] * 4  # < N each
    assert all(u["padded_numel"] == 3 * u["shard_numel"] for u in n["units"])
    assert n["numel"] == model.num_params()
    assert [len(p.params) for p in plan(model)] == [u["tensors"] for u in n["units"]]


def test_peak_is_the_bound_that_fsdp_measures_under():
    """Notebook 04 measured 637,440 / 837,376 peak parameter bytes and 2,187,156 / 2,287,124 model states at
    N = 2 without / with prefetch: the bound must hold them, params exactly."""
    model = tiny_gpt(**SHAPE)
    for prefetch, k, measured in ((False, 1, 2_187_156), (True, 2, 2_287_124)):
        m = policy_numbers(model, None, 2, prefetch=prefetch)["memory"]
        total = ROOT + 4 * BLOCK
        assert m["sharded"] == 16 * total / 2
        assert m["root"] == 8 * ROOT and m["in_flight"] == 4 * k * BLOCK and m["full_grads"] == 8 * BLOCK
        assert 4 * (total / 2 + ROOT + k * BLOCK) == (637_440, 837_376)[k - 1]
        assert measured <= m["peak"] == sum(m[c] for c in ("sharded", "root", "in_flight", "full_grads"))
        assert m["ddp"] == 16 * total


def test_policies_change_units_and_collectives():
    model = tiny_gpt(**SHAPE)
    blocks, linears = policy_numbers(model, None, 8), policy_numbers(model, nn.Linear, 8)
    whole = policy_numbers(model, WHOLE_MODEL, 8)
    assert blocks["collectives"] == {"all_gather": 10, "reduce_scatter": 5, "total": 15}
    assert len(linears["units"]) == 1 + 4 * 4 and linears["collectives"]["total"] == 3 * 17
    assert linears["memory"]["in_flight"] < blocks["memory"]["in_flight"]  # smaller units in flight
    assert linears["latency_s"] > blocks["latency_s"]  # but more messages
    assert len(whole["units"]) == 1 and whole["units"][0]["numel"] == model.num_params()
    assert whole["memory"]["root"] == 8 * whole["units"][0]["padded_numel"]  # everything whole: no saving
    assert blocks["bytes_sent"] == 3 * sum(u["padded_numel"] for u in blocks["units"]) * 7 / 8 * 4
    nested = policy_numbers(model, ["blocks.0", "blocks.0.mlp", "blocks.1", "blocks.2", "blocks.3"], 8)
    names = [u["unit"] for u in nested["units"]]
    assert "blocks.0.mlp" in names and "blocks.0" in names
    sizes = {u["unit"]: u["padded_numel"] for u in nested["units"]}
    # block 0's mlp computes inside block 0's forward: both gathered, then the next unit prefetched
    assert nested["memory"]["in_flight"] == 4 * (sizes["blocks.0"] + sizes["blocks.0.mlp"] + sizes["blocks.1"])
    single = policy_numbers(model, None, 1)
    assert single["collectives"]["total"] == 0 and single["memory"]["peak"] == 16 * model.num_params()


def test_meta_models_and_bad_input():
    with torch.device("meta"):
        big = tiny_gpt(vocab_size=50257, seq_len=1024, n_layer=12, d_model=768, n_head=12)
    n = policy_numbers(big, None, 64)
    assert 120e6 < n["numel"] < 130e6 and n["units"][0]["numel"] > n["units"][1]["numel"]  # the root: embeddings
    with pytest.raises(ValueError, match="matched no module"):
        policy_numbers(tiny_gpt(**SHAPE), nn.Conv1d, 2)
    with pytest.raises(ValueError, match="positive integer"):
        policy_numbers(tiny_gpt(**SHAPE), None, 0)


def test_the_panel_redraws_and_survives_a_bad_choice():
    models = {"tiny": tiny_gpt(**SHAPE)}
    panel = wrap_policy_explorer(models, world_size=2)
    assert panel.redraws == 1 and "5 units over N = 2 ranks" in panel.text
    assert panel.min_params.disabled
    panel.policy.value = "each Linear layer"
    assert "17 units" in panel.text and panel.figure is not None
    panel.policy.value = "min params per unit"
    assert not panel.min_params.disabled
    panel.min_params.value = 1e9  # more than the model: no unit qualifies, FSDP's own error is shown
    assert panel.numbers is None and "matched no module" in panel.text
    panel.policy.value = "whole model (one unit)"
    assert "1 units" in panel.text
    panel.prefetch.value = False
    panel.world_size.value = 1024
    assert panel.redraws == 7 and panel.numbers["world_size"] == 1024
    with pytest.raises(ValueError, match="unknown policy"):
        wrap_policy_explorer(models, policy="each layer")
