"""The memory explorer: its numbers (the ZeRO paper's Figure 1, the lectures' examples) and its widget,
built headless and redrawn by setting control values the way a slider would."""

import math

import plotly.graph_objects as go
import pytest

from toolkit import viz
from toolkit.memory import model_states
from toolkit.viz.explorer import MemoryExplorer, explorer_numbers, memory_explorer


# --- the numbers ----------------------------------------------------------------------------------------
def test_defaults_reproduce_figure_1_of_the_zero_paper():
    numbers = explorer_numbers()  # Ψ = 7.5B, N = 64, K = 12, 16-bit parameters and gradients
    assert [round(t, 1) for t in numbers["totals_gb"]] == [120.0, 31.4, 16.6, 1.9]
    assert [s["name"] for s in numbers["stages"]] == ["DP (stage 0)", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    assert (numbers["param_bytes"], numbers["grad_bytes"]) == (2, 2)


def test_one_billion_parameters_with_k16_take_20_gb_and_gpt3_size_2800_gb():
    assert explorer_numbers(1e9, 1, 16)["stages"][0]["total_gb"] == pytest.approx(20.0)
    assert explorer_numbers(1e9, 8, 16)["stages"][0]["total_gb"] == pytest.approx(20.0)  # DP: N does not help
    assert explorer_numbers(175e9, 1, 12)["stages"][0]["total_gb"] == pytest.approx(2800.0)


def test_each_stage_partitions_one_more_kind_and_agrees_with_the_formula():
    psi, n, k = 3e9, 16, 12
    stages = explorer_numbers(psi, n, k)["stages"]
    full = {"params": 2 * psi, "grads": 2 * psi, "optimizer": k * psi}
    partitioned = ([], ["optimizer"], ["optimizer", "grads"], ["optimizer", "grads", "params"])
    for stage, row in enumerate(stages):
        for part, value in full.items():
            assert row[part] == pytest.approx(value / n if part in partitioned[stage] else value)
        assert row["total"] == pytest.approx(model_states(psi, n, stage, optimizer_multiplier=k))
        assert row["bytes_per_param"] == pytest.approx(row["total"] / psi)


def test_fp32_precision_counts_4_plus_4_bytes():
    numbers = explorer_numbers(1e9, 4, 8, "fp32")
    assert (numbers["param_bytes"], numbers["grad_bytes"]) == (4, 4)
    assert numbers["totals_gb"] == pytest.approx([16.0, 8.0 + 2.0, 4.0 + 3.0, 4.0])


def test_device_memory_says_what_fits_and_the_largest_model_that_would():
    stages = explorer_numbers(7.5e9, 64, 12, device_gb=80)["stages"]
    assert [s["fits"] for s in stages] == [False, True, True, True]
    assert stages[0]["max_params"] == pytest.approx(5e9)  # 80 GB / 16 bytes per parameter
    assert stages[3]["max_params"] == pytest.approx(80e9 / (16 / 64))  # 320B
    assert "fits" not in explorer_numbers()["stages"][0]


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(precision="fp8"), "precision"),
        (dict(world_size=0), "world_size"),
        (dict(num_params=-1), "num_params"),
        (dict(device_gb=-5), "device_gb"),
    ],
)
def test_bad_input_is_a_clear_value_error(kwargs, words):
    with pytest.raises(ValueError, match=words):
        explorer_numbers(**kwargs)


# --- the widget -----------------------------------------------------------------------------------------
def _text_output(explorer):
    return "".join(o["text"] for o in explorer.output.outputs if o["output_type"] == "stream")


def _figure_totals(explorer):
    return next(t for t in explorer.figure.data if t.type == "scatter").text


def test_widget_builds_headless_and_shows_figure_1():
    explorer = memory_explorer()
    assert isinstance(explorer, MemoryExplorer) and explorer.redraws == 1
    assert isinstance(explorer.figure, go.Figure)
    assert _figure_totals(explorer) == ("120.0 GB", "31.4 GB", "16.6 GB", "1.9 GB")
    kinds = [o["output_type"] for o in explorer.output.outputs]
    assert kinds == ["display_data", "stream"]  # the figure, then the printed per-rank totals
    text = _text_output(explorer)
    for total in ("120.0 GB", "31.4 GB", "16.6 GB", "1.9 GB"):
        assert total in text
    bundle = explorer._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle


def test_moving_a_slider_redraws_the_figure_and_the_totals():
    explorer = memory_explorer()
    before_text, before_totals = _text_output(explorer), _figure_totals(explorer)
    before_outputs = explorer.output.outputs

    explorer.world_size.value = 1024  # what the slider does when a student drags it
    assert explorer.redraws == 2
    assert explorer.output.outputs != before_outputs
    assert _figure_totals(explorer) != before_totals
    assert "N = 1024" in _text_output(explorer) and _text_output(explorer) != before_text
    assert explorer.numbers["stages"][3]["total"] == pytest.approx(16 * 7.5e9 / 1024)

    explorer.num_params.value = 1e12  # a trillion parameters on 1024 ranks with ZeRO-3: 15.6 GB each
    assert explorer.numbers["stages"][3]["total_gb"] == pytest.approx(15.625)
    explorer.optimizer_multiplier.value = 16
    assert explorer.numbers["stages"][0]["bytes_per_param"] == 20
    explorer.precision.value = "fp32"
    assert (explorer.numbers["param_bytes"], explorer.numbers["grad_bytes"]) == (4, 4)
    assert explorer.redraws == 5


def test_stage_highlight_and_device_line():
    explorer = memory_explorer(stage=None)
    bars = [t for t in explorer.figure.data if t.type == "bar"]
    assert all(t.marker.opacity is None for t in bars)
    explorer.stage.value = 2
    bars = [t for t in explorer.figure.data if t.type == "bar"]
    assert all(list(t.marker.opacity) == [0.35, 0.35, 1.0, 0.35] for t in bars)
    assert "▶ ZeRO-2" in explorer.text
    assert any(getattr(s, "y0", None) == 80 for s in explorer.figure.layout.shapes)  # the 80 GB line
    explorer.device_gb.value = 0  # 0: no device line
    assert not explorer.figure.layout.shapes and "fits" not in explorer.text


def test_widget_rejects_bad_arguments_up_front():
    with pytest.raises(ValueError, match="precision"):
        memory_explorer(precision="int4")
    with pytest.raises(ValueError, match="stage"):
        memory_explorer(stage=4)


def test_exported_from_viz():
    assert viz.memory_explorer is memory_explorer and viz.explorer_numbers is explorer_numbers
    assert {"memory_explorer", "explorer_numbers", "MemoryExplorer"} <= set(viz.__all__)
    assert math.isclose(viz.explorer_numbers(7.5e9, 64)["totals_gb"][1], 31.4, abs_tol=0.05)


def test_in_a_notebook_the_figure_goes_into_the_output_not_under_the_cell(monkeypatch):
    import plotly.io as pio

    monkeypatch.setattr(pio.renderers, "default", "plotly_mimetype")  # what a Jupyter kernel uses
    explorer = memory_explorer()
    figure_entry = explorer.output.outputs[0]
    assert "application/vnd.plotly.v1+json" in figure_entry["data"]
    assert figure_entry["data"]["application/vnd.plotly.v1+json"]["data"][0]["name"] == "params"


# --- lesson 07's scale explorer: a simulated cluster behind a button ----------------------------------------
def test_the_scale_explorer_redraws_its_figure_and_verdict_on_every_click():
    """The trial: lesson 07's widget (`widgets.interactive(manual=True)`) printed a new summary on each click above
    a chart that never changed. Here three clicks, three configurations: each draws its own figure and verdict,
    at the model's full depth (48 layers for GPT-2 XL), against the cluster's GPU memory."""
    from toolkit.viz.scale_explorer import ScaleExplorer

    explorer = ScaleExplorer("GPT-2 XL", "zero3", 8, run=False)
    assert explorer.redraws == 0 and explorer.output.outputs == ()
    seen = []
    for strategy, world, cluster in (("zero3", 8, "dgx-a100"), ("ddp", 64, "dgx-a100"), ("hsdp", 64, "dgx-h100")):
        explorer.strategy.value, explorer.world_size.value, explorer.cluster.value = strategy, world, cluster
        explorer.button.click()  # what the student's click does
        row, text = explorer.row, _text_output(explorer)
        kinds = [o["output_type"] for o in explorer.output.outputs]
        assert kinds == ["display_data", "stream"] and text == explorer.text + "\n"
        assert row["layers"] == 48 and f"rank 0 of {world} on {cluster}" in text
        assert f"{row['label']} x{world}" in explorer.figure.data[0].x  # the figure is this click's
        capacity = [s.y0 for s in explorer.figure.layout.shapes]
        assert len(capacity) == 1 and capacity[0] * (
            1e9 if "GB" in explorer.figure.layout.yaxis.title.text else 1e6
        ) == pytest.approx(row["fit"].capacity, rel=1e-3)
        assert ("fits in the" in text) == row["fits"] and ("TFLOP/s" in text) == row["fits"]
        seen.append((explorer.figure.layout.title.text, text))
    assert explorer.redraws == 3 and len(set(seen)) == 3
    assert "H100" in seen[2][1] and "hsdp" in seen[2][0]


def test_the_scale_explorer_offers_only_what_applies():
    from toolkit.viz.scale_explorer import ScaleExplorer, case_text, scale_case

    explorer = ScaleExplorer(run=False)
    explorer.checkpointing.value = True
    for strategy in explorer.strategy.options:  # activation checkpointing is every strategy's option
        explorer.strategy.value = strategy
        assert explorer.checkpointing.disabled is False and explorer.checkpointing.value is True
    explorer.model.value = "MoE-GPT-S (16 experts)"  # experts are expert-parallel: ddp trains the dense part
    assert list(explorer.strategy.options) == ["ddp"] and explorer.strategy.value == "ddp"
    explorer.model.value = "GPT-3 175B"
    assert "hsdp" in explorer.strategy.options and "hybrid" not in str(explorer.widget.children)
    with pytest.raises(ValueError, match="does not apply"):
        scale_case("MoE-GPT-S (16 experts)", "zero3", 64)
    plain, checkpointed, half = (scale_case("GPT-2 XL", "ddp", 8, activation_checkpointing=c) for c in (False, True, 2))
    assert checkpointed["flops"] > 1.2 * plain["flops"]  # backward recomputes each block's forward
    assert "ddp with activation checkpointing" in case_text(checkpointed)
    # one block in 2 (GPT-2 XL's 48: 24): half the recomputation, extrapolated from 4 and 6 layers
    assert half["flops"] - plain["flops"] == pytest.approx((checkpointed["flops"] - plain["flops"]) / 2, rel=1e-6)
    assert "ddp with one block in 2 checkpointed" in case_text(half) and "with 4 and 6 of the 48" in case_text(half)
    assert [value for _, value in explorer.checkpointing.options] == [False, True, 2, 4, "op"]
    # GPT-3 on 512 GPUs under fsdp: stashed it does not fit; one block in 2 fits, between the two, in a shorter step
    none, every, second = (scale_case("GPT-3 175B", "fsdp", 512, activation_checkpointing=c) for c in (False, True, 2))
    assert every["peak"] < second["peak"] < none["peak"] and (none["fits"], every["fits"], second["fits"]) == (
        False,
        True,
        True,
    )
    assert second["step_time"] < every["step_time"]
    by_operation = scale_case("GPT-3 175B", "fsdp", 512, activation_checkpointing="op")  # keeps more, recomputes less
    assert every["peak"] < by_operation["peak"] < none["peak"] and by_operation["step_time"] < every["step_time"]
    assert "fsdp with activation checkpointing by operation" in case_text(by_operation)


def test_the_scale_explorer_simulates_moe_with_more_ranks_than_experts():
    """The trial: 5 of the widget's 6 world sizes crashed for the MoE model (16 experts on 64..1024 GPUs)."""
    from toolkit.viz.scale_explorer import scale_case

    row = scale_case("MoE-GPT-S (16 experts)", "ddp", 64)
    assert row["fits"] and row["tflops_per_gpu"] > 0 and row["layers"] == 12
