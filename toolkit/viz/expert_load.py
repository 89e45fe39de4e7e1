"""Expert load over training: which experts the router sent tokens to, forward after forward.

An MoE layer is only as fast as its busiest expert: the step waits for it, and capacity drops what
does not fit. FasterMoE measured that the choice of experts is skewed (a few popular experts take
most tokens) and that it drifts (which experts are popular changes from iteration to iteration and
over training). This figure shows both, from the ``moe/{name}/load`` records an MoE layer leaves in
a Run (``toolkit.moe.MoE.record_load``), summed over the ranks (``toolkit.moe.merge_load``):

- top: a heatmap, experts (rows) by iteration (columns, one per forward pass). The colour is an
  expert's load relative to a perfectly balanced one (tokens routed / (total / E)): 1 is white, busier
  is red, idler is blue. A black dot marks each iteration's busiest expert, so drift shows as dots
  wandering between rows. Hover gives the counts: routed, kept, over capacity, share of the tokens.
  With shadowing (``MoE(shadow=...)``) an open green square marks each expert shadowed in that
  iteration (its weights went to every rank; its tokens stayed home).
- middle: dropped (token, choice) pairs per iteration, the price of skew under a fixed capacity.
- bottom: the imbalance max/mean (busiest expert / average; 1.0 = balanced, E/k = everything on
  k experts), roughly the slowdown of the expert computation relative to a balanced load.

With several MoE layers a dropdown picks the layer (or pass ``layer=``). A pure function of a Run.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..moe.load import merge_load
from . import style

IDLE, QUIET, BALANCED, BUSY, HOT = style.LOAD_SCALE
TRACES_PER_LAYER = 4  # heatmap, busiest-expert dots, dropped bars, imbalance line (+ shadowed marks, if any)
SHADOWED = style.COMPUTE["optimizer"]


def moe_layers(run) -> list[str]:
    """Names of the MoE layers that recorded their load in this Run, in the order they first appear."""
    names = {}
    for m in run.metrics:
        name = m["name"]
        if name.startswith("moe/") and name.endswith("/load"):
            names.setdefault(name[len("moe/") : -len("/load")], None)
    return list(names)


def load_rows(run, layer: str) -> list[dict]:
    """Per forward of ``layer``: ``merge_load``'s row (step, counts, kept, dropped, max_over_mean, cv, ...)
    plus ``capacity`` (slots per expert summed over ranks), ``micro`` (forward index within its step)
    and ``owner`` (the rank that holds each expert)."""
    records = {}
    for m in run.metrics:
        if m["name"] == f"moe/{layer}/load":
            records.setdefault(m.get("rank", 0), []).append(m["value"])
    rows = merge_load(run.metrics, layer)
    num_experts = len(rows[0]["counts"]) if rows else 0
    owner = [0] * num_experts
    for rank, values in records.items():
        first, local = values[0].get("first", 0), len(values[0].get("received", [])) or num_experts
        for e in range(first, min(first + local, num_experts)):
            owner[e] = rank
    shadows = [
        m["value"].get("shadowed", [])
        for m in run.metrics  # one rank's view: every rank decides alike
        if m["name"] == f"moe/{layer}/shadow" and m.get("rank", 0) == min(records, default=0)
    ]
    seen = {}
    for i, row in enumerate(rows):
        row["shadowed"] = list(shadows[i]) if i < len(shadows) else []
        row["capacity"] = sum(values[i]["capacity"] for values in records.values())
        row["micro"] = seen.get(row["step"], 0)
        seen[row["step"]] = row["micro"] + 1
        row["owner"] = owner
    return rows


def balanced_colourscale(zmax: float) -> list:
    """Blue below 1 (idler than balance), white at 1, red above, on the colour range [0, zmax]."""
    w = 1.0 / zmax
    return [(0.0, IDLE), (w / 2, QUIET), (w, BALANCED), (w + (1 - w) / 2, BUSY), (1.0, HOT)]


def _hover(row, i: int, e: int) -> str:
    routed, kept = row["counts"][e], row["kept"][e]
    total = sum(row["counts"])
    balanced = total / len(row["counts"]) if total else 0
    when = f"iteration {i}" + (
        f" (step {row['step']}" + (f", micro-batch {row['micro']})" if row["micro"] else ")")
        if row["step"] is not None
        else ""
    )
    shadowed = " · <b>shadowed</b> (computed on every rank)" if e in row.get("shadowed", ()) else ""
    lines = [
        f"<b>expert {e}</b> on rank {row['owner'][e]} · {when}{shadowed}",
        f"routed {routed} of {total} choices ({routed / total:.1%})" if total else "routed 0",
        f"kept {kept} · over capacity {routed - kept} (capacity {row['capacity']} over all ranks)",
        f"load / balanced = {routed / balanced:.2f}" if balanced else "no tokens",
    ]
    return "<br>".join(lines)


def _layer_traces(rows, layer: str, visible: bool):
    E = len(rows[0]["counts"])
    x = list(range(len(rows)))
    z = [[(row["counts"][e] * E / sum(row["counts"])) if sum(row["counts"]) else 1.0 for row in rows] for e in range(E)]
    zmax = max(2.0, max(max(r) for r in z))  # white at 1 (balance) whatever the range
    hover = [[_hover(row, i, e) for i, row in enumerate(rows)] for e in range(E)]
    busiest = [row["counts"].index(max(row["counts"])) for row in rows]
    step_of = [row["step"] for row in rows]
    heat = go.Heatmap(
        z=z,
        x=x,
        y=list(range(E)),
        zmin=0.0,
        zmax=zmax,
        colorscale=balanced_colourscale(zmax),
        hovertext=hover,
        hoverinfo="text",
        visible=visible,
        name=f"{layer} load",
        colorbar=dict(title="load /<br>balanced", len=0.55, y=0.74),
        xgap=1,
        ygap=1,
    )
    dots = go.Scatter(
        x=x,
        y=busiest,
        mode="markers",
        name="busiest expert",
        visible=visible,
        marker=dict(color=style.MARK, size=5, symbol="circle"),
        customdata=[[s, max(row["counts"])] for s, row in zip(step_of, rows)],
        hovertemplate="iteration %{x} (step %{customdata[0]})<br>busiest: expert %{y}, "
        "%{customdata[1]} choices<extra></extra>",
    )
    dropped = go.Bar(
        x=x,
        y=[row["dropped"] for row in rows],
        name="dropped",
        visible=visible,
        marker_color=style.ALERT,
        showlegend=False,
        customdata=[[s, sum(row["counts"]), row["capacity"]] for s, row in zip(step_of, rows)],
        hovertemplate="iteration %{x} (step %{customdata[0]})<br>%{y} of %{customdata[1]} choices "
        "dropped<br>capacity %{customdata[2]} per expert over all ranks<extra></extra>",
    )
    imbalance = go.Scatter(
        x=x,
        y=[row["max_over_mean"] for row in rows],
        mode="lines+markers",
        visible=visible,
        name="max / mean",
        line=dict(color=style.SEQUENCE[0]),
        marker=dict(size=4),
        showlegend=False,
        customdata=[[s, row["cv"]] for s, row in zip(step_of, rows)],
        hovertemplate="iteration %{x} (step %{customdata[0]})<br>max/mean %{y:.2f}"
        "<br>coefficient of variation %{customdata[1]:.2f}<extra></extra>",
    )
    traces = [heat, dots, dropped, imbalance]
    marks = [(i, e) for i, row in enumerate(rows) for e in row.get("shadowed", ())]
    if marks:
        traces.append(
            go.Scatter(
                x=[i for i, _ in marks],
                y=[e for _, e in marks],
                mode="markers",
                name="shadowed",
                visible=visible,
                marker=dict(color=SHADOWED, size=12, symbol="square-open", line=dict(width=2)),
                hovertemplate="iteration %{x}<br>expert %{y} shadowed: its weights went to every "
                "rank, its tokens stayed home<extra></extra>",
            )
        )
    return traces


def _title(layer: str, rows) -> str:
    return f"Expert load of MoE layer {layer!r}"


def _subtitle(rows) -> str:
    E, worst = len(rows[0]["counts"]), max(row["max_over_mean"] for row in rows)
    dropped = sum(row["dropped"] for row in rows)
    total = sum(sum(row["counts"]) for row in rows)
    changes = sum(
        a["counts"].index(max(a["counts"])) != b["counts"].index(max(b["counts"])) for a, b in zip(rows, rows[1:])
    )
    return (
        f"{E} experts, {len(rows)} iterations · worst max/mean {worst:.2f} · {dropped / total:.1%} of "
        f"choices dropped · busiest expert changed {changes} times"
    )


def expert_load(run, layer: str | None = None, *, title: str | None = None) -> go.Figure:
    """Heatmap of expert load (experts x iterations) with dropped tokens and max/mean imbalance below.

    layer: the MoE layer's name (its ``name=``; in the MoE-GPT ``layer0``, ``layer1``, ...). None shows
    the first and adds a dropdown to switch between layers when there are several.
    """
    layers = moe_layers(run)
    if not layers:
        raise ValueError(
            "this Run has no expert-load records (metrics 'moe/<layer>/load'): train a model with "
            "toolkit.moe.MoE layers (e.g. toolkit.train.moe_model_fn) with the recorder enabled."
        )
    if layer is not None and layer not in layers:
        raise ValueError(f"no MoE layer named {layer!r} recorded its load in this Run; choose one of {layers}.")
    shown = [layer] if layer is not None else layers
    tables = {name: load_rows(run, name) for name in shown}

    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, row_heights=[0.6, 0.2, 0.2], vertical_spacing=0.05)
    owner_of_trace = []  # which layer each trace belongs to (a layer has 4 traces, 5 with shadowed marks)
    for i, name in enumerate(shown):
        for trace, row in zip(_layer_traces(tables[name], name, visible=i == 0), (1, 1, 2, 3, 1)):
            fig.add_trace(trace, row=row, col=1)
            owner_of_trace.append(i)
    fig.add_hline(y=1.0, line=dict(color=style.THEORY, dash="dot", width=1), row=3, col=1)  # balance

    first = tables[shown[0]]
    E = len(first[0]["counts"])
    fig.update_yaxes(title_text="expert", autorange="reversed", dtick=1 if E <= 16 else None, row=1, col=1)
    fig.update_yaxes(title_text="dropped", rangemode="tozero", row=2, col=1)
    fig.update_yaxes(title_text="max/mean", rangemode="tozero", row=3, col=1)
    fig.update_xaxes(title_text="iteration (one forward pass of the layer)", row=3, col=1)
    # title, then a row with the layer dropdown (left) and the legend (right), then the plot
    style.place_title(fig, title or _title(shown[0], first), _subtitle(first), above_plot_px=44)
    fig.update_layout(
        template="plotly_white",
        height=400 + 14 * min(E, 32),
        margin=dict(l=10, r=10, b=40),
        legend=dict(orientation="h", y=1.01, x=1, xanchor="right", yanchor="bottom"),
    )
    if len(shown) > 1:
        buttons = []
        for i, name in enumerate(shown):
            visible = [owner == i for owner in owner_of_trace]
            heading = fig.layout.title.text if title else _title(name, tables[name])
            buttons.append(
                dict(
                    label=name,
                    method="update",
                    args=[
                        {"visible": visible},
                        {"title.text": heading, "title.subtitle.text": _subtitle(tables[name])},
                    ],
                )
            )
        fig.update_layout(
            updatemenus=[
                dict(
                    buttons=buttons,
                    direction="down",
                    x=0.0,
                    xanchor="left",
                    y=1.01,
                    yanchor="bottom",
                    showactive=True,
                    pad=dict(t=0, b=0),
                )
            ]
        )
    return fig
