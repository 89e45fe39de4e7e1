"""The DDL-roofline (FasterMoE): where a distributed MoE layer stands between computing and talking.

x: R_CC = Lat_comp / Lat_comm, how long the experts compute against how long the all-to-alls take.
y: P̄, the expert FLOPs each rank gets done per second of the layer's end-to-end latency.
Two reference lines, for a rank whose experts compute at P FLOP/s:

    ideal        P · min(1, R_CC)      communication hidden entirely behind computation (or vice versa)
    semi-ideal   P · R_CC / (R_CC + 1)  the two one after the other, nothing overlapped

The plain layer (dispatch, experts, combine in turn) sits on the semi-ideal line; a schedule that
overlaps (FasterMoE's smart schedule, Tutel's pipelining) climbs toward the ideal one; shadowing and the
topology gate move the point right (less to communicate); imbalance pulls it down (ranks wait for the
busiest one).

A point from a Run (``roofline_point``), for the MoE layers' forward passes:

1. Each rank's forwards are told apart by their count exchange (the all-to-all labelled "counts").
   In one forward, the layer's traffic for steps 4-6 is every comm span whose ``args.moe`` starts
   with "dispatch" or "combine" (not "... backward"): the plain all-to-alls, pipelined chunks, smart
   schedule steps; its compute is every "moe/<layer>/experts" (and "shadowed experts") span without
   ``backward``.
2. Per rank and forward: Lat_e2e = from the first of those spans' start to the last one's end;
   Lat_comp = the union of its expert spans; FLOPs = 4 · rows · d_model · d_ff (two matrix products
   per row: d_model -> d_ff -> d_model; rows from the spans' ``rows``); Lat_comm = the time the
   transfers need. On an emulated link (spans with ``args.emulated_s``) that is the link's busy
   time by the model: sends and receives each use their own side of a full-duplex link, so
   max(sum over calls that send, sum over calls that receive) of ``emulated_s``, whatever the
   schedule. Without emulation it is the time at least one transfer was in flight (union of the comm
   spans): exact for the plain layer's blocking all-to-alls, an upper bound for overlapped schedules,
   whose early-posted transfers stay in flight while they wait for their peers.
3. Per forward, over the N ranks: each latency is the slowest rank's (the paper's max over workers),
   FLOPs the sum; P = sum of FLOPs / sum of the ranks' Lat_comp (the expert GEMM rate achieved).
4. Over forwards (after ``skip`` warm-up ones): the median of each. Then R_CC = Lat_comp / Lat_comm and
   P̄ = FLOPs / (N · Lat_e2e).

The lines are drawn for ``peak`` (default: the largest P among the points), so a configuration whose
experts computed slower (small chunks) sits below them by that much. Pure functions; nothing runs.
"""

from __future__ import annotations

import math
import statistics

import plotly.graph_objects as go

from ..trace.analysis import _length, _union
from . import style

POINT_KEYS = ("r_cc", "throughput")
COLOURS = style.SEQUENCE


def _is_forward_traffic(e) -> bool:
    tag = str(e["args"].get("moe", ""))
    return e["cat"] == "comm" and tag.startswith(("dispatch", "combine")) and "backward" not in tag


def _is_forward_experts(e) -> bool:
    return (
        e["cat"] == "compute"
        and e["name"].startswith("moe/")
        and e["name"].endswith(("/experts", "/shadowed experts"))  # shadowed rows are computed at home
        and not e["args"].get("backward", False)
    )


def _forwards(events) -> list[dict]:
    """One rank's forwards: per count exchange, its steps-4-6 traffic and expert spans."""
    groups, current = [], None
    for e in sorted(events, key=lambda e: e["start"]):
        if e["cat"] == "comm" and e["args"].get("moe") == "counts":
            current = {"comm": [], "compute": []}
            groups.append(current)
        elif current is not None and _is_forward_traffic(e):
            current["comm"].append(e)
        elif current is not None and _is_forward_experts(e):
            current["compute"].append(e)
    return [g for g in groups if g["comm"] or g["compute"]]


def _link_time(comm) -> float:
    """Lat_comm of one forward on one rank: the emulated link's busy time, else the time in flight."""
    if comm and all("emulated_s" in e["args"] for e in comm):
        sends = sum(e["args"]["emulated_s"] for e in comm if e["name"] != "recv")
        receives = sum(e["args"]["emulated_s"] for e in comm if e["name"] != "send")
        return max(sends, receives)
    return _length(_union((e["start"], e["end"]) for e in comm))


def roofline_point(run, d_model: int, d_ff: int, *, label: str | None = None, skip: int = 0) -> dict:
    """The DDL-roofline point of the MoE layers in ``run`` (see the module docstring for the recipe).

    Returns {"label", "r_cc", "throughput" (FLOP/s per rank), "peak" (P, FLOP/s), "lat_comp",
    "lat_comm", "lat_e2e" (s), "flops" (per forward, all ranks), "ranks", "forwards"}.
    """
    for key, value in (("d_model", d_model), ("d_ff", d_ff)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"roofline_point: {key} must be a positive int, got {value!r}.")
    if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
        raise ValueError(f"roofline_point: skip must be an int >= 0, got {skip!r}.")
    ranks = sorted({e["rank"] for e in run.events})
    per_rank = {r: _forwards([e for e in run.events if e["rank"] == r]) for r in ranks}
    ranks = [r for r in ranks if per_rank[r]]
    if not ranks:
        raise ValueError(
            "roofline_point: this Run has no MoE forward to measure (no 'counts' exchange followed "
            "by dispatch/combine traffic or moe/<layer>/experts spans). Record the MoE layer's "
            "forward passes (toolkit.trace.recorder enabled) and capture the Run on every rank."
        )
    count = min(len(per_rank[r]) for r in ranks)
    if count <= skip:
        raise ValueError(f"roofline_point: skip={skip} leaves none of the {count} forward(s) recorded.")
    rows = []
    for i in range(skip, count):
        per = []
        for r in ranks:
            g = per_rank[r][i]
            spans = g["comm"] + g["compute"]
            flops = 4 * d_model * d_ff * sum(int(e["args"].get("rows", 0)) for e in g["compute"])
            per.append(
                {
                    "e2e": max(e["end"] for e in spans) - min(e["start"] for e in spans),
                    "comm": _link_time(g["comm"]),
                    "comp": _length(_union((e["start"], e["end"]) for e in g["compute"])),
                    "flops": flops,
                }
            )
        comp_total = sum(p["comp"] for p in per)
        rows.append(
            {
                "lat_e2e": max(p["e2e"] for p in per),
                "lat_comm": max(p["comm"] for p in per),
                "lat_comp": max(p["comp"] for p in per),
                "flops": sum(p["flops"] for p in per),
                "peak": sum(p["flops"] for p in per) / comp_total if comp_total > 0 else 0.0,
            }
        )
    point = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    if point["lat_comm"] <= 0 or point["lat_e2e"] <= 0:
        raise ValueError(
            "roofline_point: the MoE forwards in this Run have no communication time (one rank, or "
            "no dispatch/combine traffic): R_CC = Lat_comp / Lat_comm is undefined."
        )
    n = len(ranks)
    point.update(
        label=label if label is not None else run.config.get("label", f"{n} ranks"),
        r_cc=point["lat_comp"] / point["lat_comm"],
        throughput=point["flops"] / (n * point["lat_e2e"]),
        ranks=n,
        forwards=len(rows),
    )
    return point


def ideal(r_cc: float, peak: float) -> float:
    """Computation and communication perfectly overlapped: P · min(1, R_CC)."""
    return peak * min(1.0, r_cc)


def semi_ideal(r_cc: float, peak: float) -> float:
    """Computation then communication, nothing overlapped: P · R_CC / (R_CC + 1)."""
    return peak * r_cc / (r_cc + 1.0)


def _as_points(runs_or_points, d_model, d_ff, skip) -> list[dict]:
    if isinstance(runs_or_points, dict) and not all(k in runs_or_points for k in POINT_KEYS):
        items = list(runs_or_points.items())  # {label: Run or point}
    elif isinstance(runs_or_points, dict) or hasattr(runs_or_points, "events"):
        items = [(None, runs_or_points)]  # one point, one Run
    else:
        items = [(None, item) for item in runs_or_points]
    if not items:
        raise ValueError("roofline needs at least one Run or point.")
    points = []
    for i, (name, item) in enumerate(items):
        if hasattr(item, "events"):
            if d_model is None or d_ff is None:
                raise ValueError("roofline: pass d_model= and d_ff= (the experts' sizes) to measure points from Runs.")
            point = roofline_point(
                item, d_model, d_ff, skip=skip, label=name if name is not None else item.config.get("label", f"run {i}")
            )
        elif isinstance(item, dict):
            missing = [k for k in POINT_KEYS if k not in item]
            if missing:
                raise ValueError(
                    f"roofline: point {i} ({item!r}) lacks {missing}; a point needs r_cc (compute / "
                    f"communication) and throughput (FLOP/s per rank), optionally label and peak."
                )
            point = dict(item, label=name if name is not None else item.get("label", f"point {i}"))
        else:
            raise ValueError(f"roofline: item {i} is a {type(item).__name__}; give Runs or point dicts.")
        for key in POINT_KEYS:
            value = point[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
                raise ValueError(
                    f"roofline: point {point['label']!r} has {key}={value!r}; it must be a positive number."
                )
        points.append(point)
    return points


def roofline(
    runs_or_points,
    *,
    d_model: int | None = None,
    d_ff: int | None = None,
    peak: float | None = None,
    skip: int = 0,
    title: str | None = None,
) -> go.Figure:
    """The DDL-roofline with one labelled point per configuration.

    runs_or_points: a list of Runs and/or points ({"label", "r_cc", "throughput"[, "peak"]}), or a dict
    {label: Run or point}. Runs are measured by ``roofline_point`` (needs ``d_model`` and ``d_ff``;
    ``skip`` warm-up forwards). ``peak``: P for the reference lines (default: the largest point's
    "peak", else the largest throughput). Log-log axes; throughput in GFLOP/s per rank.
    """
    points = _as_points(runs_or_points, d_model, d_ff, skip)
    if peak is None:
        peak = max(p.get("peak") or 0.0 for p in points) or max(p["throughput"] for p in points)
    elif isinstance(peak, bool) or not isinstance(peak, (int, float)) or not peak > 0:
        raise ValueError(f"roofline: peak must be a positive FLOP/s, got {peak!r}.")
    xs = [p["r_cc"] for p in points]
    lo, hi = min(xs + [1.0]) / 10, max(xs + [1.0]) * 10
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=grid,
            y=[ideal(x, peak) / 1e9 for x in grid],
            mode="lines",
            name="ideal: P·min(1, R)",
            line=dict(color=style.THEORY),
        )
    )
    fig.add_trace(
        go.Scatter(
            x=grid,
            y=[semi_ideal(x, peak) / 1e9 for x in grid],
            mode="lines",
            name="semi-ideal: P·R/(R+1)",
            line=dict(color=style.THEORY, dash="dash"),
        )
    )
    for i, p in enumerate(points):
        hover = [
            f"<b>{p['label']}</b>",
            f"R_CC {p['r_cc']:.3g}",
            f"throughput {p['throughput'] / 1e9:.3g} GFLOP/s per rank",
            f"ideal here {ideal(p['r_cc'], peak) / 1e9:.3g}, semi-ideal {semi_ideal(p['r_cc'], peak) / 1e9:.3g}",
        ]
        for key, name in (("lat_comp", "Lat_comp"), ("lat_comm", "Lat_comm"), ("lat_e2e", "Lat_e2e")):
            if key in p:
                hover.append(f"{name} {p[key] * 1e3:.3g} ms")
        if p.get("peak"):
            hover.append(f"expert compute rate P {p['peak'] / 1e9:.3g} GFLOP/s")
        fig.add_trace(
            go.Scatter(
                x=[p["r_cc"]],
                y=[p["throughput"] / 1e9],
                mode="markers+text",
                name=str(p["label"]),
                text=[str(p["label"])],
                textposition="top center",
                marker=dict(size=11, color=COLOURS[i % len(COLOURS)]),
                hovertext=["<br>".join(hover)],
                hoverinfo="text",
            )
        )
    style.place_title(
        fig,
        title or "DDL-roofline",
        f"P = {peak / 1e9:.3g} GFLOP/s per rank: the experts' compute rate that the reference lines assume",
    )
    fig.update_layout(
        template="plotly_white",
        xaxis=dict(type="log", title="R_CC = Lat_comp / Lat_comm"),
        yaxis=dict(type="log", title="throughput per rank (GFLOP/s)"),
        margin=dict(l=10, r=10, b=40),
    )
    return fig
