"""Memory and communication side by side with the theory: stacked bars per strategy and rank.

Measured numbers come from a Run's memory samples (the ledger, taken at phase boundaries); predicted
ones from `toolkit.memory.model_states`. Bars stack params, grads, optimizer and activations; a
diamond marks what the formula predicts for the model states (params + grads + optimizer).
"""

from __future__ import annotations

import plotly.graph_objects as go

from ..memory import model_states_breakdown
from ..units import byte_unit, bytes_text, memory_text
from . import style

CATEGORIES = ("params", "grads", "optimizer", "activations")
PEAK_CATEGORIES = ("params", "gathered", "grads", "optimizer", "comm", "activations", "temporary")  # a simulated peak
COLOURS = style.MEMORY
UNIT_NAMES = {1: "B", 1e3: "kB", 1e6: "MB", 1e9: "GB", 1e12: "TB"}


def _unit(unit, largest: float) -> tuple[float, str]:
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
    unit, name_of_unit = _unit(unit, largest)
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


def peak_bars(
    peaks: dict,
    *,
    capacity: float | None = None,
    device: str = "device",
    predicted: dict | None = None,
    title=None,
    subtitle=None,
) -> go.Figure:
    """What a rank holds at the moment of its peak, every category stacked (they add up to the peak), one bar per
    case, against the device's memory (a dashed line) and the formula's model states (diamonds).

    peaks: {label: {category: bytes}} (a Simulation's `peak_memory`); capacity: the device's bytes;
    predicted: {label: bytes of params + grads + optimizer by the formula}. The unit follows the magnitude.
    """
    labels = list(peaks)
    totals = [sum(peaks[k].values()) for k in labels]
    unit, name_of_unit = _unit(None, max(totals + [capacity or 0] + list((predicted or {}).values()) + [1]))
    categories = [c for c in PEAK_CATEGORIES if any(peaks[k].get(c) for k in labels)] + sorted(
        {c for k in labels for c in peaks[k] if c not in PEAK_CATEGORIES and peaks[k][c]}
    )
    fig = go.Figure(
        [
            go.Bar(
                x=labels,
                y=[peaks[k].get(c, 0) / unit for k in labels],
                name=c,
                marker_color=COLOURS.get(c, style.COMPUTE["other"]),
                customdata=[bytes_text(peaks[k].get(c, 0)) for k in labels],
                hovertemplate="%{x}<br>" + c + ": %{customdata}<extra></extra>",
            )
            for c in categories
        ]
    )
    fig.add_trace(
        go.Scatter(
            x=labels,
            y=[t / unit for t in totals],
            mode="text",
            showlegend=False,
            hoverinfo="skip",
            text=[f"peak {bytes_text(t)}" for t in totals],
            textposition="top center",
        )
    )
    if predicted:
        shown = [k for k in labels if k in predicted]
        fig.add_trace(
            go.Scatter(
                x=shown,
                y=[predicted[k] / unit for k in shown],
                mode="markers",
                name="formula: model states",
                marker=dict(symbol="diamond", size=11, color=style.THEORY),
                customdata=[bytes_text(predicted[k]) for k in shown],
                hovertemplate="%{x}<br>formula params+grads+optimizer: %{customdata}<extra></extra>",
            )
        )
    if capacity:
        fig.add_hline(
            y=capacity / unit,
            line_dash="dash",
            line_color=style.ALERT,
            annotation_text=f"{device}: {memory_text(capacity)}",
            annotation_position="top left",
        )
    top = max(totals + [capacity or 0]) / unit
    fig.update_yaxes(range=[0, 1.15 * top if top > 0 else 1], title_text=f"{name_of_unit} per rank")
    style.place_title(
        fig,
        title or "Memory at the peak, by category",
        subtitle
        if subtitle is not None
        else "what the rank holds at its peak moment (the categories add up to the peak)"
        + (" · dashed: the device's memory" if capacity else "")
        + (" · diamonds: the formula's model states" if predicted else ""),
    )
    fig.update_layout(barmode="stack", height=460, template="plotly_white", legend_orientation="h", legend_y=-0.2)
    return fig


def comm_bars(rows: list[dict], *, unit: float | None = None, title=None) -> go.Figure:
    """Bytes each rank sends per step, measured (bars) against theory (diamonds).

    rows: [{"strategy", "measured", "theory"}] in bytes; unit: bytes per plotted unit (None: by magnitude).
    """
    labels = [r["strategy"] for r in rows]
    unit, name_of_unit = _unit(unit, max([max(r["measured"], r["theory"]) for r in rows] + [0]))
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
    unit, name_of_unit = _unit(unit, max(sum(p.values()) for p in parts))
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


# --- memory over time ------------------------------------------------------------------------------------
# A sample taken by `FSDPModel.watch_memory` carries an "event": "<what> <unit>", e.g. "gathered blocks.0".
EVENT_MARKERS = {
    "gathered": ("triangle-up", style.COMMUNICATION["all_gather"]),
    "prefetch": ("triangle-right", style.shade(style.COMMUNICATION["all_gather"], 2)),
    "freed": ("triangle-down", style.ALERT),
    "backward done": ("circle-open", style.COMPUTE["emulated"]),
    "reduce-scatter": ("x", style.shade(style.COMMUNICATION["reduce_scatter"], 2)),
}
LINE_CATEGORIES = CATEGORIES + ("states", "total")  # states: params + grads + optimizer


def _event_kind(label: str) -> tuple[str, str]:
    """("gathered", "blocks.0") from "gathered blocks.0"; (label, "") when the label is not a unit event."""
    for kind in EVENT_MARKERS:
        if label.startswith(kind + " "):
            return kind, label[len(kind) + 1 :]
    return label, ""


def memory_over_time(
    run,
    rank=None,
    *,
    step=None,
    categories=CATEGORIES + ("total",),
    unit: float = 1e3,
    bound=None,
    bound_label: str = "bound",
    title: str | None = None,
) -> go.Figure:
    """Memory per category against time from the Run's samples: one line per category and one for the total
    (params + grads + optimizer + activations), one panel per rank (`rank=None`: every rank; an int or a
    list: those). categories may also name "states", the model states (params + grads + optimizer), the
    quantity the FSDP paper bounds.

    Samples are the ledger's (`record_memory`): phase boundaries in `train`, and with
    `FSDPModel.watch_memory` one at every unit's gather, prefetch, free and reduce-scatter. Those carry an
    "event" label; the figure marks each on the total line (gathered ▲, prefetched ▶, freed ▼,
    reduce-scatter ×; on the total line, else on the states line, else on the first category) and names
    its unit on hover, so a unit coming and going is visible.
    step: only the samples of these step(s). unit: bytes per plotted unit (1e3: KB).
    bound: a horizontal dashed line per panel, in bytes (a number, or {rank: number}), e.g. a formula's
    peak for params + grads + optimizer. Lines are steps (memory holds its value until the next sample).
    Time is milliseconds since the first sample shown.
    """
    from plotly.subplots import make_subplots

    wanted = run.ranks if rank is None else [rank] if isinstance(rank, int) else list(rank)
    steps = None if step is None else {step} if isinstance(step, int) else set(step)
    unknown = set(categories) - set(LINE_CATEGORIES)
    if unknown:
        raise ValueError(f"memory_over_time: unknown categories {sorted(unknown)}; valid: {list(LINE_CATEGORIES)}.")
    rows = {
        r: sorted(
            (s for s in run.samples if s["rank"] == r and (steps is None or s.get("step") in steps)),
            key=lambda s: s["time"],
        )
        for r in wanted
    }
    shown = [s for r in wanted for s in rows[r]]
    if not shown:
        raise ValueError(
            f"memory_over_time: the Run has no memory samples for rank(s) {wanted}"
            + (f" in step(s) {sorted(steps)}" if steps is not None else "")
            + ". Samples come from train (sample_memory=True) or FSDPModel.watch_memory()."
        )
    t0 = min(s["time"] for s in shown)
    label = {1: "B", 1e3: "KB", 1e6: "MB", 1e9: "GB"}.get(unit, f"x{unit:g} B")
    fig = make_subplots(
        rows=len(wanted),
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.1 if len(wanted) > 1 else 0,
        subplot_titles=[f"rank {r}" for r in wanted],
    )
    colours = COLOURS
    sums = {"total": CATEGORIES, "states": ("params", "grads", "optimizer")}
    for i, r in enumerate(wanted, start=1):
        samples = rows[r]
        x = [(s["time"] - t0) * 1e3 for s in samples]
        values = {
            c: [sum(s.get(k, 0) for k in sums[c]) if c in sums else s.get(c, 0) for s in samples] for c in categories
        }
        hover = [f"{s.get('event') or s.get('phase', '')} · step {s.get('step')}" for s in samples]
        for c in categories:
            fig.add_trace(
                go.Scatter(
                    x=x,
                    y=[v / unit for v in values[c]],
                    mode="lines",
                    line_shape="hv",
                    name=c,
                    legendgroup=c,
                    showlegend=i == 1,
                    line=dict(color=colours[c], width=3 if c in sums else 2),
                    customdata=hover,
                    hovertemplate=f"rank {r} · {c}: %{{y:.1f}} {label}<br>%{{customdata}}<extra></extra>",
                ),
                row=i,
                col=1,
            )
        anchor = next((c for c in ("total", "states") if c in categories), categories[0])
        anchor_values = values[anchor]
        for kind, (symbol, colour) in EVENT_MARKERS.items():
            hits = [j for j, s in enumerate(samples) if s.get("event") and _event_kind(s["event"])[0] == kind]
            if hits:
                fig.add_trace(
                    go.Scatter(
                        x=[x[j] for j in hits],
                        y=[anchor_values[j] / unit for j in hits],
                        mode="markers",
                        name=kind,
                        legendgroup=f"event {kind}",
                        showlegend=i == 1,
                        marker=dict(symbol=symbol, size=9, color=colour, line=dict(width=1.5, color=colour)),
                        text=[samples[j]["event"] for j in hits],
                        hovertemplate=f"rank {r} · %{{text}}<br>{anchor}: %{{y:.1f}} {label}<extra></extra>",
                    ),
                    row=i,
                    col=1,
                )
        level = bound.get(r) if isinstance(bound, dict) else bound
        if level is not None:
            fig.add_trace(
                go.Scatter(
                    x=[x[0], x[-1]],
                    y=[level / unit] * 2,
                    mode="lines",
                    name=bound_label,
                    legendgroup="bound",
                    showlegend=i == 1,
                    line=dict(color=style.THEORY, dash="dash", width=1.5),
                    hovertemplate=f"{bound_label}: %{{y:.1f}} {label}<extra></extra>",
                ),
                row=i,
                col=1,
            )
        fig.update_yaxes(title_text=f"{label}", row=i, col=1)
    fig.update_xaxes(title_text="time since the first sample (ms)", row=len(wanted), col=1)
    style.place_title(
        fig,
        title or "Memory over time per rank",
        "the ledger's samples; markers: a unit gathered ▲, prefetched ▶, freed ▼, its gradients reduce-scattered ×",
        above_plot_px=24,
    )
    fig.update_layout(
        template="plotly_white",
        height=160 + 260 * len(wanted),
        legend=dict(orientation="h", y=-0.12 if len(wanted) > 1 else -0.25),
        hovermode="closest",
        margin=dict(l=10, r=10, b=40),
    )
    return fig
