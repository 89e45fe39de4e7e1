"""Memory per category against time, from a Run's samples: one panel per rank, FSDP's unit events marked.

A sample taken by `FSDPModel.watch_memory` carries an "event": "<what> <unit>", e.g. "gathered blocks.0";
the figure marks each, so a unit coming and going is visible on the total line.
"""

from __future__ import annotations

import plotly.graph_objects as go

from .. import style
from .bars import CATEGORIES, COLOURS

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
