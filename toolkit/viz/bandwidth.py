"""Bandwidth and time against message size, per collective: backend versus hand-written, and the model.

Small messages are dominated by latency (the alpha of the alpha-beta model: every step of an
algorithm pays it), large ones by bandwidth (beta, seconds per byte), so achieved bandwidth climbs
with size and levels off. Plotting algorithm bandwidth (size / time) next to bus bandwidth (what the
busiest link carried, nccl-tests' convention) shows both at once; overlaying the alpha-beta model
shows how much of the measurement the two-parameter model explains.

Figures take measurement records (`toolkit.comm.measure`) or a Run that carries them; they run nothing.
"""

from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..comm.fit import fit_alpha_beta
from ..comm.measure import bus_factor, records_from_run
from ..comm.measure_table import implementation_label, size_label
from ..memory.formulas import alpha_beta_time
from ..units import bandwidth_text, byte_unit, bytes_text
from . import style

METRIC_DASH = {"algbw": "solid", "busbw": "dash"}
MODEL_COLOUR = style.THEORY


def _records(data) -> list[dict]:
    """Accept a list of records or a Run that carries them."""
    return records_from_run(data) if hasattr(data, "metrics") else list(data)


def _ops_in(records, ops):
    present = list(dict.fromkeys(r["op"] for r in records))
    return [op for op in ops if op in present] if ops is not None else present


def _impl_name(impl: str) -> str:
    """The legend's name of an implementation: "ring" (the switch) ran the ring or, for all-to-all, the
    pairwise exchange, so the legend says "hand-written" and each panel's title says which."""
    return "hand-written" if impl == "ring" else impl


def _panel_titles(records, ops) -> list[str]:
    return [
        f"{op} (hand-written: pairwise)"
        if op == "all_to_all" and any(r["op"] == op and r["impl"] == "ring" for r in records)
        else op
        for op in ops
    ]


def _grid(count: int):
    cols = min(3, max(count, 1))
    return math.ceil(max(count, 1) / cols), cols


# --- the model ------------------------------------------------------------------------------------
def _model_params(model, records):
    if model is None:
        return None
    if model == "fit":
        has_ring = any(r["impl"] == "ring" for r in records)
        return fit_alpha_beta(records, "ring" if has_ring else None)
    if isinstance(model, dict):
        return float(model["alpha"]), float(model["beta"])
    alpha, beta = model
    return float(alpha), float(beta)


def model_label(alpha: float, beta: float) -> str:
    bandwidth = bandwidth_text(1 / beta) if beta > 0 else "∞"
    return f"alpha-beta model (α = {alpha * 1e6:.0f} µs, 1/β = {bandwidth})"


# --- hover -----------------------------------------------------------------------------------------
def _hover(r) -> str:
    agree = {
        None: "not compared",
        True: "agrees with the other implementation",
        False: "DISAGREES with the other implementation",
    }[r.get("agree")]
    return "<br>".join(
        [
            f"<b>{r['op']}</b> · {implementation_label(r['impl'], r.get('algorithm', r['impl']))} · "
            f"{r['world_size']} ranks",
            f"size {size_label(r['size_bytes'])}",
            f"time {r['seconds'] * 1e3:.3f} ms (median of {r.get('repeats', '?')}, slowest rank)",
            f"algbw {bandwidth_text(r['algbw'])} · busbw {bandwidth_text(r['busbw'])}",
            agree,
        ]
    )


# --- the figures -------------------------------------------------------------------------------------
def _size_grid(records, op):
    sizes = [r["size_bytes"] for r in records if r["op"] == op]
    return np.geomspace(min(sizes), max(sizes), 40) if sizes else np.array([])


def _world(records, op):
    return next(r["world_size"] for r in records if r["op"] == op)


def bandwidth(data, *, ops=None, metrics=("algbw", "busbw"), model=None, title: str | None = None) -> go.Figure:
    """Achieved bandwidth against message size, one panel per collective, one line per implementation.

    metrics: "algbw" (size / time, solid) and/or "busbw" (algbw × the collective's bus factor, dashed).
    model: None, "fit" (fit alpha and beta to the ring's records), or (alpha, beta) in seconds and
    seconds per byte: adds the model's bandwidth (busbw if shown, else algbw) as a dotted grey line.
    """
    records = _records(data)
    unknown = set(metrics) - set(METRIC_DASH)
    if unknown or not metrics:
        raise ValueError(f"metrics must be some of {tuple(METRIC_DASH)}, got {metrics!r}.")
    ops = _ops_in(records, ops)
    rows, cols = _grid(len(ops))
    fig = make_subplots(
        rows=rows, cols=cols, subplot_titles=_panel_titles(records, ops), horizontal_spacing=0.07, vertical_spacing=0.14
    )
    params = _model_params(model, records)
    scale, unit = byte_unit(max(r[m] for r in records for m in metrics))  # kB/s for small messages, not 0.000 GB/s
    shown = set()
    for i, op in enumerate(ops):
        row, col = i // cols + 1, i % cols + 1
        for impl in dict.fromkeys(r["impl"] for r in records if r["op"] == op):
            points = sorted((r for r in records if r["op"] == op and r["impl"] == impl), key=lambda r: r["size_bytes"])
            for metric in metrics:
                name = f"{_impl_name(impl)} {metric}"
                fig.add_trace(
                    go.Scatter(
                        x=[r["size_bytes"] for r in points],
                        y=[r[metric] / scale for r in points],
                        mode="lines+markers",
                        name=name,
                        legendgroup=name,
                        showlegend=name not in shown,
                        line=dict(
                            color=style.IMPLEMENTATIONS.get(impl, style.IMPLEMENTATIONS["custom"]),
                            dash=METRIC_DASH[metric],
                        ),
                        hovertext=[_hover(r) for r in points],
                        hoverinfo="text",
                    ),
                    row=row,
                    col=col,
                )
                shown.add(name)
        if params is not None:
            sizes, n = _size_grid(records, op), _world(records, op)
            metric = "busbw" if "busbw" in metrics else "algbw"
            factor = bus_factor(op, n) if metric == "busbw" else 1.0
            modelled = [s / alpha_beta_time(op, s, n, *params) * factor / scale for s in sizes]
            name = model_label(*params) + f" ({metric})"
            fig.add_trace(
                go.Scatter(
                    x=sizes,
                    y=modelled,
                    mode="lines",
                    name=name,
                    legendgroup="model",
                    showlegend="model" not in shown,
                    hoverinfo="skip",
                    line=dict(color=MODEL_COLOUR, dash="dot"),
                ),
                row=row,
                col=col,
            )
            shown.add("model")
    fig.update_xaxes(type="log", title_text="message size")
    fig.update_yaxes(title_text=f"{unit}/s", rangemode="tozero")
    style.readable_log_axes(fig, {"x": bytes_text})
    world = sorted({r["world_size"] for r in records})
    style.place_title(
        fig,
        title or f"Achieved bandwidth on {', '.join(map(str, world))} ranks",
        "solid: algbw = size / time · dashed: busbw, comparable with one link's speed",
        above_plot_px=30,
    )
    fig.update_layout(template="plotly_white", height=320 * rows + 110, margin=dict(l=10, r=10, b=40))
    return fig


def collective_times(data, *, ops=None, model=None, title: str | None = None) -> go.Figure:
    """Time against message size on log-log axes, per collective: where latency gives way to bandwidth.

    model as in `bandwidth`: the alpha-beta line is flat (steps·alpha) for small messages and rises
    with slope one (bytes·beta) for large ones.
    """
    records = _records(data)
    ops = _ops_in(records, ops)
    rows, cols = _grid(len(ops))
    fig = make_subplots(
        rows=rows, cols=cols, subplot_titles=_panel_titles(records, ops), horizontal_spacing=0.07, vertical_spacing=0.14
    )
    params = _model_params(model, records)
    shown = set()
    for i, op in enumerate(ops):
        row, col = i // cols + 1, i % cols + 1
        for impl in dict.fromkeys(r["impl"] for r in records if r["op"] == op):
            points = sorted((r for r in records if r["op"] == op and r["impl"] == impl), key=lambda r: r["size_bytes"])
            fig.add_trace(
                go.Scatter(
                    x=[r["size_bytes"] for r in points],
                    y=[r["seconds"] * 1e3 for r in points],
                    error_y=dict(
                        type="data",
                        symmetric=False,
                        array=[(r["seconds_max"] - r["seconds"]) * 1e3 for r in points],
                        arrayminus=[(r["seconds"] - r["seconds_min"]) * 1e3 for r in points],
                        thickness=1,
                    ),
                    mode="lines+markers",
                    name=_impl_name(impl),
                    legendgroup=impl,
                    showlegend=impl not in shown,
                    line=dict(color=style.IMPLEMENTATIONS.get(impl, style.IMPLEMENTATIONS["custom"])),
                    hovertext=[_hover(r) for r in points],
                    hoverinfo="text",
                ),
                row=row,
                col=col,
            )
            shown.add(impl)
        if params is not None:
            sizes, n = _size_grid(records, op), _world(records, op)
            fig.add_trace(
                go.Scatter(
                    x=sizes,
                    y=[alpha_beta_time(op, s, n, *params) * 1e3 for s in sizes],
                    mode="lines",
                    name=model_label(*params),
                    legendgroup="model",
                    showlegend="model" not in shown,
                    hoverinfo="skip",
                    line=dict(color=MODEL_COLOUR, dash="dot"),
                ),
                row=row,
                col=col,
            )
            shown.add("model")
    fig.update_xaxes(type="log", title_text="message size")
    fig.update_yaxes(type="log", title_text="ms")
    style.readable_log_axes(fig, {"x": bytes_text, "y": lambda v: f"{v:g}"})
    style.place_title(
        fig,
        title or "Time per collective",
        "median of the repetitions; error bars: the fastest and the slowest",
        above_plot_px=30,
    )
    fig.update_layout(template="plotly_white", height=320 * rows + 110, margin=dict(l=10, r=10, b=40))
    return fig
