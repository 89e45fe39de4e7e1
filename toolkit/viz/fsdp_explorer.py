"""The wrap-policy explorer: pick how FSDP cuts a model into units and see what it costs, without launching.

The units come from the same code FSDP itself uses (`toolkit.parallel.fsdp_policy.plan`: the wrap policy,
the root taking what is left, tied weights moved to their lowest common ancestor), run on one process on
a model that may live on the meta device (shapes only: a 1.5B-parameter GPT costs nothing to build).
From the units and the number of ranks N it predicts, per rank:

- each unit's flat parameter: elements, padding to a multiple of N (< N per unit), elements per shard;
- peak memory of the model states (bytes, fp32 AdamW as in `toolkit.parallel.fsdp`):
      16 B x Σ padded_i / N               the shards: fp32 master 4 + gradient 4 + AdamW moments 8
    + (4 + 4) B x root                    the root unit encloses the whole forward: it stays gathered,
                                          and its full gradient lives through backward
    + 4 B x in-flight units               the largest unit gathered (with its enclosing units), plus
                                          the next one when it is prefetched
    + 4 B x full gradients in flight      one unit's gradient filling, the previous one's reduce-scatter
  This is the FSDP paper's "sharded model plus the largest fully materialized unit(s)", spelled out for
  this implementation; `tests/test_fsdp.py` checks the measured peak against it;
- collectives per step: 2 all-gathers + 1 reduce-scatter per unit, and the bytes they send,
  3 Σ padded_i (N-1)/N x 4 B, with an alpha-beta estimate of their time (the latency term grows with
  the number of units: many small units waste the link).

Two layers, as `explorer.py`: `policy_numbers(...)` (pure, tested) and `wrap_policy_explorer(...)`, the
ipywidgets panel. Building the panel computes once and shows; every control recomputes (milliseconds).
"""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go
import torch
import torch.nn as nn
from plotly.subplots import make_subplots

from ..memory.formulas import alpha_beta_time
from ..parallel.flat import padded_numel
from ..parallel.fsdp_policy import UnitPlan, plan
from . import style

WHOLE_MODEL = "whole model"
POLICIES = {  # label -> what it means (the "min params" policy takes its number from the slider)
    "each transformer block (default)": None,
    "each Linear layer": nn.Linear,
    "min params per unit": "min params",
    "whole model (one unit)": WHOLE_MODEL,
}
SHARD_BYTES = 16  # per element of a shard: fp32 master 4 + fp32 gradient 4 + AdamW moments 8
PARAM_BYTES = GRAD_BYTES = 4  # fp32 gathered parameters and full gradients
ALPHA, BANDWIDTH = 20e-6, 25e9  # a link for the time estimate: 20 µs per message, 25 GB/s


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


def units_of(model: nn.Module, policy=None) -> list[UnitPlan]:
    """FSDP's units for `policy` (see fsdp_policy.py), or one root unit for WHOLE_MODEL."""
    if isinstance(policy, str) and policy == WHOLE_MODEL:
        params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
        return [UnitPlan("", model, params)]
    return plan(model, policy)


def _chain(name: str, names: list[str], sizes: dict) -> int:
    """Elements gathered while unit `name` computes: it and every non-root unit enclosing it."""
    return sum(sizes[n] for n in names if n == name or name.startswith(n + "."))


def policy_numbers(
    model: nn.Module,
    policy=None,
    world_size: int = 8,
    *,
    prefetch: bool = True,
    alpha: float = ALPHA,
    bandwidth: float = BANDWIDTH,
) -> dict:
    """What the explorer shows for `model` cut into units by `policy`, sharded over `world_size` ranks.

    Returns {"units": [{unit, tensors, numel, padded_numel, padding, shard_numel}] (root first), "numel",
    "padding", "memory": {sharded, root, in_flight, full_grads, peak, ddp} in bytes per rank,
    "collectives": {all_gather, reduce_scatter, total} per step, "bytes_sent" per rank per step,
    "comm_s" and "latency_s" (alpha-beta estimate of the step's collectives, and its latency part)}.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}.")
    plans = units_of(model, policy)
    rows = []
    for p in plans:
        numel = sum(t.numel() for t in p.params)
        padded = padded_numel(numel, world_size)
        rows.append(
            {
                "unit": p.name or "(root)",
                "tensors": len(p.params),
                "numel": numel,
                "padded_numel": padded,
                "padding": padded - numel,
                "shard_numel": padded // world_size,
            }
        )
    root = rows[0]["padded_numel"] if plans[0].name == "" else 0
    inner = [r for r, p in zip(rows, plans) if p.name]
    names = [r["unit"] for r in inner]
    sizes = {r["unit"]: r["padded_numel"] for r in inner}
    largest = max(sizes.values(), default=0)
    gathered = max((_chain(n, names, sizes) for n in names), default=0)
    if prefetch and len(inner) > 1:
        gathered += largest  # the next unit's all-gather is issued while this one computes
    full_grads = largest * min(2, len(inner))  # one filling, the previous one reduce-scattering
    total_padded = sum(r["padded_numel"] for r in rows)
    N = world_size
    memory = {
        "sharded": SHARD_BYTES * total_padded / N if N > 1 else SHARD_BYTES * total_padded,
        "root": (PARAM_BYTES + GRAD_BYTES) * root if N > 1 else 0,
        "in_flight": PARAM_BYTES * gathered if N > 1 else 0,
        "full_grads": GRAD_BYTES * full_grads if N > 1 else 0,
    }
    memory["peak"] = sum(memory.values())
    memory["ddp"] = SHARD_BYTES * sum(r["numel"] for r in rows)  # every rank holds everything
    beta = 1 / bandwidth
    comm = latency = 0.0
    for r in rows:  # forward all-gather, backward all-gather, reduce-scatter
        size = r["padded_numel"] * PARAM_BYTES
        for op in ("all_gather", "all_gather", "reduce_scatter"):
            comm += alpha_beta_time(op, size, N, alpha, beta)
            latency += alpha_beta_time(op, size, N, alpha, 0.0)
    U = len(rows) if N > 1 else 0
    return {
        "units": rows,
        "numel": sum(r["numel"] for r in rows),
        "padding": sum(r["padding"] for r in rows),
        "world_size": N,
        "prefetch": prefetch,
        "memory": memory,
        "collectives": {"all_gather": 2 * U, "reduce_scatter": U, "total": 3 * U},
        "bytes_sent": 3 * total_padded * (N - 1) / N * PARAM_BYTES,
        "comm_s": comm,
        "latency_s": latency,
    }


def _size(nbytes: float) -> str:
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "KB")):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def _count(n: float) -> str:
    for value, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= value:
            return f"{n / value:.3g}{suffix}"
    return f"{n:.0f}"


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
            f"{len(n['units'])} units over N = {n['world_size']} ranks: the smallest {_count(sizes[0])}, the largest "
            f"{_count(sizes[-1])} elements; padding {n['padding']:,} elements in all (< N per unit).",
            f"predicted peak model states per rank: {_size(m['peak'])} = shards {_size(m['sharded'])} + root "
            f"{_size(m['root'])} + in flight {_size(m['in_flight'])} + full gradients {_size(m['full_grads'])}; "
            f"data parallelism would hold {_size(m['ddp'])} ({m['ddp'] / m['peak']:.1f}x).",
            f"collectives per step: {n['collectives']['all_gather']} all-gathers + "
            f"{n['collectives']['reduce_scatter']} reduce-scatters = {n['collectives']['total']}, "
            f"sending {_size(n['bytes_sent'])} per rank; at "
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
        from .explorer import _bundle

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
            outputs = (_bundle(self.figure),)
        except ValueError as exc:  # a policy that matches nothing: FSDP's own message
            self.numbers, self.figure, self.text, outputs = None, None, f"{exc}", ()
        self.output.outputs = outputs + ({"output_type": "stream", "name": "stdout", "text": self.text + "\n"},)
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
