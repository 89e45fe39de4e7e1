"""Memory and communication side by side with the theory: stacked bars per strategy and rank.

Measured numbers come from a Run's memory samples (the ledger, taken at phase boundaries); predicted
ones from `toolkit.memory.model_states`. Bars stack params, grads, optimizer and activations; a
diamond marks what the formula predicts for the model states (params + grads + optimizer).
"""
from __future__ import annotations

import plotly.graph_objects as go

from ..memory import model_states_breakdown

CATEGORIES = ("params", "grads", "optimizer", "activations")
COLOURS = {"params": "#4C78A8", "grads": "#F58518", "optimizer": "#54A24B", "activations": "#B279A2"}


def peak_by_category(run, rank: int) -> dict:
    """The largest value each category reached on `rank` over the Run's samples (bytes)."""
    rows = [s for s in run.samples if s["rank"] == rank]
    return {c: max((s.get(c, 0) for s in rows), default=0) for c in CATEGORIES}


def memory_bars(runs: dict, predicted: dict | None = None, *, unit: float = 1e6, title=None) -> go.Figure:
    """Stacked measured peaks per category, one bar per (strategy, rank); `predicted[label]` marks the theory.

    runs: {label: merged Run}; predicted: {label: bytes per rank of params + grads + optimizer}.
    """
    x, values = [], {c: [] for c in CATEGORIES}
    marks_x, marks_y = [], []
    for label, run in runs.items():
        for rank in run.ranks:
            name = f"{label} · r{rank}"
            x.append(name)
            peaks = peak_by_category(run, rank)
            for c in CATEGORIES:
                values[c].append(peaks[c] / unit)
            if predicted and label in predicted:
                marks_x.append(name)
                marks_y.append(predicted[label] / unit)
    fig = go.Figure([go.Bar(x=x, y=values[c], name=c, marker_color=COLOURS[c],
                            hovertemplate="%{x}<br>" + c + ": %{y:.3f} MB<extra></extra>") for c in CATEGORIES])
    if marks_x:
        fig.add_trace(go.Scatter(x=marks_x, y=marks_y, mode="markers", name="theory: model states",
                                 marker=dict(symbol="diamond", size=11, color="black"),
                                 hovertemplate="%{x}<br>predicted params+grads+optimizer: %{y:.3f} MB<extra></extra>"))
    fig.update_layout(barmode="stack", title=title or "Measured peak memory per rank (bars) and the formula (diamonds)",
                      yaxis_title="MB per rank", xaxis_tickangle=-40, height=460, legend_orientation="h",
                      legend_y=-0.35)
    return fig


def comm_bars(rows: list[dict], *, unit: float = 1e6, title=None) -> go.Figure:
    """Bytes each rank sends per step, measured (bars) against theory (diamonds).

    rows: [{"strategy", "measured", "theory"}] in bytes.
    """
    labels = [r["strategy"] for r in rows]
    fig = go.Figure([
        go.Bar(x=labels, y=[r["measured"] / unit for r in rows], name="measured (trace)", marker_color="#4C78A8",
               hovertemplate="%{x}: %{y:.3f} MB sent per step<extra></extra>"),
        go.Scatter(x=labels, y=[r["theory"] / unit for r in rows], mode="markers", name="theory",
                   marker=dict(symbol="diamond", size=12, color="black"),
                   hovertemplate="%{x}: theory %{y:.3f} MB<extra></extra>"),
    ])
    fig.update_layout(title=title or "Bytes each rank sends per training step", yaxis_title="MB per rank per step",
                      height=380)
    return fig


def model_states_bars(num_params: float, world_size: int, *, optimizer_multiplier: float = 12,
                      param_bytes: float = 2, grad_bytes: float = 2, unit: float = 1e9) -> go.Figure:
    """The theory alone: params / grads / optimizer per rank for data parallelism and ZeRO 1, 2, 3."""
    stages = ["DP (stage 0)", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    parts = [model_states_breakdown(num_params, world_size, s, param_bytes=param_bytes, grad_bytes=grad_bytes,
                                    optimizer_multiplier=optimizer_multiplier) for s in range(4)]
    fig = go.Figure([go.Bar(x=stages, y=[p[c] / unit for p in parts], name=c, marker_color=COLOURS[c],
                            hovertemplate="%{x}<br>" + c + ": %{y:.2f} GB<extra></extra>")
                     for c in ("params", "grads", "optimizer")])
    totals = [sum(p.values()) / unit for p in parts]
    fig.add_trace(go.Scatter(x=stages, y=totals, mode="text", text=[f"{t:.1f} GB" for t in totals],
                             textposition="top center", showlegend=False, hoverinfo="skip"))
    fig.update_layout(barmode="stack", height=420, yaxis_title="GB per rank",
                      title=f"Model states per rank: Ψ = {num_params:,.0f}, N = {world_size}, K = {optimizer_multiplier}")
    return fig
