"""Where a strategy stops fitting, or stops scaling: TFLOP/s per GPU over the number of GPUs (`toolkit.sim.sweep`).

A case whose peak does not fit in the GPU's memory has no rate (it would not run): it is drawn as a hollow
marker on the axis, its peak on hover, and the title says so only when there is one.
"""

from __future__ import annotations

import plotly.graph_objects as go

from ..units import bytes_text, seconds_text
from . import style


def _hover(r) -> str:
    head = f"{r['label']} x{r['world_size']}: "
    if not r["fits"]:
        return head + f"does not fit: peak {bytes_text(r['peak'])} > {bytes_text(r['fit'].capacity)}"
    b = r["breakdown"]
    return head + (
        f"step {seconds_text(r['step_time'])}, exposed communication {seconds_text(b['exposed_comm'])}, "
        f"peak {bytes_text(r['peak'])}"
    )


def scaling(rows, *, title: str = "TFLOP/s per GPU as the cluster grows") -> go.Figure:
    """One line per label of `sweep` rows: the cluster's useful TFLOP/s per GPU against the number of GPUs."""
    fig = go.Figure()
    for i, label in enumerate(dict.fromkeys(r["label"] for r in rows)):
        mine = sorted((r for r in rows if r["label"] == label), key=lambda r: r["world_size"])
        colour = style.SEQUENCE[i % len(style.SEQUENCE)]
        fig.add_trace(
            go.Scatter(
                x=[r["world_size"] for r in mine],
                y=[r["tflops_per_gpu"] if r["fits"] else 0 for r in mine],
                name=label,
                mode="lines+markers",
                line=dict(color=colour),
                marker=dict(
                    size=11,
                    color=colour,
                    symbol=["circle" if r["fits"] else "circle-open" for r in mine],
                    line=dict(width=2, color=colour),
                ),
                hovertext=[_hover(r) for r in mine],
                hoverinfo="text",
            )
        )
    missing = [r for r in rows if not r["fits"]]
    note = (
        f" · hollow, on the axis: does not fit in {bytes_text(missing[0]['fit'].capacity)} (no rate)" if missing else ""
    )
    style.place_title(fig, title, "the cluster's useful FLOPs per GPU (all ranks' work / GPUs / step time)" + note)
    fig.update_layout(
        xaxis=dict(type="log", title="GPUs"), yaxis_title="TFLOP/s per GPU", template="plotly_white", height=440
    )
    return fig
