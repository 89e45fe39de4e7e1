"""The wrap-policy explorer: pick how FSDP cuts a model into units and see what it costs, without launching.

A model (the notebook's tiny GPT, or GPT-2 small or XL built on the meta device: shapes only), a wrap policy,
the number of ranks N and prefetching: every change recomputes `fsdp_units.policy_numbers` (milliseconds;
its docstring spells out the prediction) and redraws each unit's elements and padding beside the predicted
peak per rank, with the collectives per step and their alpha-beta time printed under them.

Two layers, as `explorer.py`: `policy_numbers(...)` (pure, tested; `fsdp_units.py`) and
`wrap_policy_explorer(...)`, the ipywidgets panel here. Building the panel computes once and shows.
"""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go
import torch
import torch.nn as nn
from plotly.subplots import make_subplots

from ..units import bytes_text, count_text
from . import style
from .fsdp_units import ALPHA, BANDWIDTH, WHOLE_MODEL, policy_numbers, units_of
from .panel_output import show

POLICIES = {  # label -> what it means (the "min params" policy takes its number from the slider)
    "each transformer block (default)": None,
    "each Linear layer": nn.Linear,
    "min params per unit": "min params",
    "whole model (one unit)": WHOLE_MODEL,
}


def gpt_models() -> dict:
    """The explorer's models: the notebook's tiny GPT and two GPT-2 sizes, built on the meta device."""
    from ..models import tiny_gpt

    shapes = {
        "tiny GPT (notebook 04)": dict(n_layer=4, d_model=64, n_head=4),
        "GPT-2 small (124M)": dict(vocab_size=50257, seq_len=1024, n_layer=12, d_model=768, n_head=12),
        "GPT-2 XL (1.5B)": dict(vocab_size=50257, seq_len=1024, n_layer=48, d_model=1600, n_head=25),
    }
    with torch.device("meta"):
        return {name: tiny_gpt(**shape) for name, shape in shapes.items()}


MEMORY_PARTS = (
    ("sharded", "shards: 16 B x Σψ/N", style.MEMORY["states"]),
    ("root", "root: gathered + full gradient", style.MEMORY["params"]),
    ("in_flight", "units in flight (gathered)", style.COMMUNICATION["all_gather"]),
    ("full_grads", "full gradients in flight", style.MEMORY["grads"]),
)


def policy_figure(numbers: dict, title: str = "") -> go.Figure:
    """Left: every unit's elements (padding on top); right: the predicted peak per rank, stacked."""
    n = numbers
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.68, 0.32],
        horizontal_spacing=0.1,
        subplot_titles=[
            f"{len(n['units'])} units: elements per flat parameter",
            f"predicted peak per rank ({'with' if n['prefetch'] else 'no'} prefetch)",
        ],
    )
    names = [u["unit"] for u in n["units"]]
    fig.add_trace(
        go.Bar(
            x=names,
            y=[u["numel"] for u in n["units"]],
            name="parameters",
            marker_color=style.MEMORY["params"],
            hovertemplate="%{x}: %{y:,} elements<extra></extra>",
        ),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Bar(
            x=names,
            y=[u["padding"] for u in n["units"]],
            name="padding",
            marker_color=style.ALERT,
            hovertemplate="%{x}: %{y} padding elements<extra></extra>",
        ),
        row=1,
        col=1,
    )
    for key, label, colour in MEMORY_PARTS:
        fig.add_trace(
            go.Bar(
                x=["FSDP"],
                y=[n["memory"][key] / 1e6],
                name=label,
                marker_color=colour,
                hovertemplate=f"{label}: %{{y:.3g}} MB<extra></extra>",
            ),
            row=1,
            col=2,
        )
    style.place_title(fig, title, above_plot_px=30)  # room for the panels' own titles
    fig.update_layout(
        barmode="stack",
        height=450,
        template="plotly_white",
        legend=dict(orientation="h", y=-0.35),
        margin=dict(l=10, r=10, b=40),
    )
    fig.update_xaxes(showticklabels=len(names) <= 40, tickangle=-45, row=1, col=1)
    fig.update_yaxes(title_text="elements", row=1, col=1)
    fig.update_yaxes(title_text="MB per rank", row=1, col=2)
    return fig


def summary_text(numbers: dict) -> str:
    n, m = numbers, numbers["memory"]
    sizes = sorted(u["numel"] for u in n["units"])
    return "\n".join(
        [
            f"{len(n['units'])} units over N = {n['world_size']} ranks: the smallest {count_text(sizes[0])}, "
            f"the largest {count_text(sizes[-1])} elements; padding {n['padding']:,} elements in all (< N per unit).",
            f"predicted peak model states per rank: {bytes_text(m['peak'])} = shards {bytes_text(m['sharded'])} + "
            f"root {bytes_text(m['root'])} + in flight {bytes_text(m['in_flight'])} + full gradients "
            f"{bytes_text(m['full_grads'])}; "
            f"data parallelism would hold {bytes_text(m['ddp'])} ({m['ddp'] / m['peak']:.1f}x).",
            f"collectives per step: {n['collectives']['all_gather']} all-gathers + "
            f"{n['collectives']['reduce_scatter']} reduce-scatters = {n['collectives']['total']}, "
            f"sending {bytes_text(n['bytes_sent'])} per rank; at "
            f"{ALPHA * 1e6:g} µs and {BANDWIDTH / 1e9:g} GB/s about {n['comm_s'] * 1e3:.3g} ms, of which "
            f"{n['latency_s'] * 1e3:.3g} ms ({n['latency_s'] / n['comm_s']:.0%}) is latency."
            if n["comm_s"] > 0
            else "one rank: nothing to shard, nothing to send.",
        ]
    )


class WrapPolicyExplorer:
    """Model, wrap policy, min params (for that policy), N and prefetch over an Output with the figure and
    the numbers. `numbers`, `figure` and `text` hold what is shown; `redraws` counts the redraws."""

    def __init__(
        self,
        models: dict | None = None,
        *,
        policy: str = "each transformer block (default)",
        world_size: int = 8,
        prefetch: bool = True,
        min_params: int = 10_000,
    ):
        self.models = models or gpt_models()
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {list(POLICIES)}.")
        style = {"description_width": "120px"}
        self.model = widgets.Dropdown(options=list(self.models), description="model", style=style)
        self.policy = widgets.Dropdown(
            options=list(POLICIES),
            value=policy,
            description="wrap policy",
            style=style,
            layout=widgets.Layout(width="420px"),
        )
        self.min_params = widgets.FloatLogSlider(
            value=min_params,
            base=10,
            min=2,
            max=9,
            step=0.05,
            readout_format=".3g",
            description="min params",
            style=style,
            continuous_update=False,
            layout=widgets.Layout(width="420px"),
        )
        self.world_size = widgets.SelectionSlider(
            options=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024],
            value=world_size,
            description="N ranks",
            style=style,
            continuous_update=False,
        )
        self.prefetch = widgets.Checkbox(value=prefetch, description="prefetch the next unit")
        self.output = widgets.Output()
        self.numbers, self.figure, self.text, self.redraws = None, None, "", 0
        for control in (self.model, self.policy, self.min_params, self.world_size, self.prefetch):
            control.observe(self.redraw, names="value")
        self.widget = widgets.VBox(
            [
                widgets.HBox(
                    [
                        widgets.VBox([self.model, self.policy, self.min_params]),
                        widgets.VBox([self.world_size, self.prefetch]),
                    ]
                ),
                self.output,
            ]
        )
        self.redraw()

    def current_policy(self):
        policy = POLICIES[self.policy.value]
        return int(self.min_params.value) if policy == "min params" else policy

    def redraw(self, _change=None) -> None:
        self.min_params.disabled = POLICIES[self.policy.value] != "min params"
        try:
            self.numbers = policy_numbers(
                self.models[self.model.value],
                self.current_policy(),
                self.world_size.value,
                prefetch=self.prefetch.value,
            )
            self.figure = policy_figure(self.numbers, f"{self.model.value}, {self.policy.value}")
            self.text = summary_text(self.numbers)
        except ValueError as exc:  # a policy that matches nothing: FSDP's own message
            self.numbers, self.figure, self.text = None, None, f"{exc}"
        show(self.output, self.figure, self.text)
        self.redraws += 1

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


def wrap_policy_explorer(models: dict | None = None, **options) -> WrapPolicyExplorer:
    """The interactive wrap-policy explorer (see `WrapPolicyExplorer`); models: {label: nn.Module}
    (default: `gpt_models()`); options: policy (a label of POLICIES), world_size, prefetch, min_params."""
    return WrapPolicyExplorer(models, **options)


__all__ = [
    "POLICIES",
    "WHOLE_MODEL",
    "WrapPolicyExplorer",
    "gpt_models",
    "policy_figure",
    "policy_numbers",
    "summary_text",
    "units_of",
    "wrap_policy_explorer",
]
