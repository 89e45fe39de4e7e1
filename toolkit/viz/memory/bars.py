"""Memory and communication side by side with the theory: stacked bars per strategy and rank.

Measured numbers come from a Run's memory samples (the ledger, taken at phase boundaries); predicted
ones from `toolkit.memory.model_states`. Bars stack params, grads, optimizer and activations; a
diamond marks what the formula predicts for the model states (params + grads + optimizer).
"""

from __future__ import annotations

import plotly.graph_objects as go

from ...memory import model_states_breakdown
from ...units import byte_unit
from .. import style

CATEGORIES = ("params", "grads", "optimizer", "activations")
COLOURS = style.MEMORY
UNIT_NAMES = {1: "B", 1e3: "kB", 1e6: "MB", 1e9: "GB", 1e12: "TB"}


def axis_unit(unit, largest: float) -> tuple[float, str]:
    """(bytes per unit, name): the one given, else the one the largest value calls for."""
    if unit is None:
        return byte_unit(largest)
    return unit, UNIT_NAMES.get(unit, f"x{unit:g} B")


def peak_by_category(run, rank: int) -> dict:
    """The largest value each category reached on `rank` over the Run's samples (bytes)."""
    rows = [s for s in run.samples if s["rank"] == rank]
    return {c: max((s.get(c, 0) for s in rows), default=0) for c in CATEGORIES}


def memory_bars(runs: dict, predicted: dict | None = None, *, unit: float | None = None, title=None) -> go.Figure:
    """Stacked measured peaks per category, one bar per (strategy, rank); `predicted[label]` marks the theory.

    runs: {label: merged Run}; predicted: {label: bytes per rank of params + grads + optimizer}; unit: bytes
    per plotted unit (1e6: MB), None: the one the largest bar calls for.
    """
    peaks = {(label, rank): peak_by_category(run, rank) for label, run in runs.items() for rank in run.ranks}
    largest = max([sum(p.values()) for p in peaks.values()] + list((predicted or {}).values()) + [0])
    unit, name_of_unit = axis_unit(unit, largest)
    x = [f"{label} · r{rank}" for label, rank in peaks]
    values = {c: [p[c] / unit for p in peaks.values()] for c in CATEGORIES}
    marks = [(f"{label} · r{rank}", predicted[label] / unit) for label, rank in peaks if label in (predicted or {})]
    fig = go.Figure(
        [
            go.Bar(
                x=x,
                y=values[c],
                name=c,
                marker_color=COLOURS[c],
                hovertemplate="%{x}<br>" + c + ": %{y:.3g} " + name_of_unit + "<extra></extra>",
            )
            for c in CATEGORIES
        ]
    )
    if marks:
        fig.add_trace(
            go.Scatter(
                x=[m[0] for m in marks],
                y=[m[1] for m in marks],
                mode="markers",
                name="theory: model states",
                marker=dict(symbol="diamond", size=11, color=style.THEORY),
                hovertemplate="%{x}<br>predicted params+grads+optimizer: %{y:.3g} " + name_of_unit + "<extra></extra>",
            )
        )
    style.place_title(
        fig,
        title or "Peak memory per rank, measured and predicted",
        "bars: measured peak per category · diamonds: the formula for params + grads + optimizer",
    )
    fig.update_layout(
        barmode="stack",
        yaxis_title=f"{name_of_unit} per rank",
        xaxis_tickangle=-40,
        height=480,
        legend_orientation="h",
        legend_y=-0.35,
    )
    return fig


def comm_bars(rows: list[dict], *, unit: float | None = None, title=None) -> go.Figure:
    """Bytes each rank sends per step, measured (bars) against theory (diamonds).

    rows: [{"strategy", "measured", "theory"}] in bytes; unit: bytes per plotted unit (None: by magnitude).
    """
    labels = [r["strategy"] for r in rows]
    unit, name_of_unit = axis_unit(unit, max([max(r["measured"], r["theory"]) for r in rows] + [0]))
    fig = go.Figure(
        [
            go.Bar(
                x=labels,
                y=[r["measured"] / unit for r in rows],
                name="measured (trace)",
                marker_color=style.MEMORY["params"],
                hovertemplate="%{x}: %{y:.3g} " + name_of_unit + " sent per step<extra></extra>",
            ),
            go.Scatter(
                x=labels,
                y=[r["theory"] / unit for r in rows],
                mode="markers",
                name="theory",
                marker=dict(symbol="diamond", size=12, color=style.THEORY),
                hovertemplate="%{x}: theory %{y:.3g} " + name_of_unit + "<extra></extra>",
            ),
        ]
    )
    style.place_title(
        fig,
        title or "Bytes each rank sends per training step",
        "bars: measured from the trace (median step) · diamonds: theory",
    )
    fig.update_layout(yaxis_title=f"{name_of_unit} per rank per step", height=400)
    return fig


def model_states_bars(
    num_params: float,
    world_size: int,
    *,
    optimizer_multiplier: float = 12,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    unit: float | None = None,
) -> go.Figure:
    """The theory alone: params / grads / optimizer per rank for data parallelism and ZeRO 1, 2, 3 (unit: bytes
    per plotted unit; None: by the magnitude of the largest stage)."""
    stages = ["DP (stage 0)", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    parts = [
        model_states_breakdown(
            num_params,
            world_size,
            s,
            param_bytes=param_bytes,
            grad_bytes=grad_bytes,
            optimizer_multiplier=optimizer_multiplier,
        )
        for s in range(4)
    ]
    unit, name_of_unit = axis_unit(unit, max(sum(p.values()) for p in parts))
    fig = go.Figure(
        [
            go.Bar(
                x=stages,
                y=[p[c] / unit for p in parts],
                name=c,
                marker_color=COLOURS[c],
                hovertemplate="%{x}<br>" + c + ": %{y:.3g} " + name_of_unit + "<extra></extra>",
            )
            for c in ("params", "grads", "optimizer")
        ]
    )
    totals = [sum(p.values()) / unit for p in parts]
    fig.add_trace(
        go.Scatter(
            x=stages,
            y=totals,
            mode="text",
            text=[f"{t:.3g} {name_of_unit}" for t in totals],
            textposition="top center",
            showlegend=False,
            hoverinfo="skip",
        )
    )
    style.place_title(
        fig,
        "Model states per rank under DP and ZeRO 1, 2, 3",
        f"Ψ = {num_params:,.0f} parameters, N = {world_size} ranks, K = {optimizer_multiplier}",
    )
    fig.update_layout(barmode="stack", height=440, yaxis_title=f"{name_of_unit} per rank")
    return fig
