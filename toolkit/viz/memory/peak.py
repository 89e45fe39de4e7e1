"""What a simulated rank holds at the moment of its peak, every category stacked, against the device's memory.

A Simulation's `peak_memory` splits the peak into more categories than a real run's ledger samples (the
gathered parameters, communication buffers, temporaries): the bars show them all, so they add up to the peak.
"""

from __future__ import annotations

import plotly.graph_objects as go

from ...units import bytes_text, memory_text
from .. import style
from .bars import COLOURS, axis_unit

PEAK_CATEGORIES = ("params", "gathered", "grads", "optimizer", "comm", "activations", "temporary")  # a simulated peak


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
    unit, name_of_unit = axis_unit(None, max(totals + [capacity or 0] + list((predicted or {}).values()) + [1]))
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
