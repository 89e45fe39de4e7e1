"""The timeline: what every rank was doing, and when, drawn from a Run's spans.

One lane per rank, split into two sub-lanes: communication on top, compute under it, so a glance
shows whether a rank computed while its collectives were in flight (overlap) or waited for them.
Communication spans are coloured by operation, and hatched when a hand-written implementation
(ring, pairwise) ran them instead of the backend. Hovering a span tells its size, the bytes this rank
sent and received, its duration and the bandwidth it achieved.

A pure function of a Run: it draws what was recorded and runs nothing.
"""
from __future__ import annotations

import plotly.graph_objects as go

from ..comm.measure import bus_factor, size_label

OPERATION_COLOURS = {
    "all_reduce": "#1f77b4", "reduce_scatter": "#ff7f0e", "all_gather": "#2ca02c",
    "broadcast": "#d62728", "all_to_all": "#9467bd", "send": "#8c564b", "recv": "#e377c2",
    "barrier": "#7f7f7f",
}
SPARE_COLOURS = ("#17becf", "#bcbd22", "#393b79", "#8c6d31", "#843c39", "#7b4173")
COMPUTE_COLOURS = ("#9e9e9e", "#c7c7c7", "#6b6b6b", "#b5a58c", "#8fa3a8")
HANDWRITTEN_PATTERN = "/"  # backend spans are solid; ring/pairwise/custom ones are hatched
LANES = ("comm", "compute")


def lane_name(rank: int, lane: str) -> str:
    return f"rank {rank} · {'comm' if lane == 'comm' else 'compute'}"


def colour_of(name: str, _spare: dict = {}) -> str:  # noqa: B006 - a deliberate per-process memo
    """A stable colour per operation; operations the table does not know get spare colours in turn."""
    if name in OPERATION_COLOURS:
        return OPERATION_COLOURS[name]
    if name not in _spare:
        _spare[name] = SPARE_COLOURS[len(_spare) % len(SPARE_COLOURS)]
    return _spare[name]


def _selected(run, ranks, phase, where):
    prefixes = (phase,) if isinstance(phase, str) else tuple(phase) if phase is not None else None
    keep = set(ranks) if ranks is not None else None
    return [e for e in run.events
            if (keep is None or e["rank"] in keep)
            and (prefixes is None or str(e.get("phase", "")).startswith(prefixes))
            and (where is None or where(e))]


def _bandwidth(nbytes: float, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.3f} GB/s" if seconds > 0 else "n/a"


def _duration(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} µs" if seconds * 1e6 < 999.5 else f"{seconds * 1e3:.3f} ms"


def comm_hover(event) -> str:
    """The hover text of one communication span: what moved, how long it took, how fast that was."""
    a, seconds = event["args"], max(event["end"] - event["start"], 0.0)
    size = a.get("size_bytes", 0)
    lines = [f"<b>{event['name']}</b> ({a.get('impl', '?')}) · rank {event['rank']}",
             f"size {size_label(size)} ({a.get('numel', '?')} × {a.get('dtype', '?')})",
             f"sent {size_label(a.get('bytes_sent', 0))} · received {size_label(a.get('bytes_recv', 0))}",
             f"duration {_duration(seconds)}"]
    if size and seconds > 0:
        bw = f"algbw {_bandwidth(size, seconds)}"
        group = a.get("group") or []
        try:
            bw += f" · busbw {size * bus_factor(event['name'], len(group)) / seconds / 1e9:.3f} GB/s"
        except ValueError:  # send, recv, barrier: no bus factor
            pass
        lines.append(bw)
    lines.append(f"phase {event.get('phase', '')} · group {a.get('group', '?')}")
    return "<br>".join(lines)


def compute_hover(event) -> str:
    seconds = max(event["end"] - event["start"], 0.0)
    extra = ", ".join(f"{k}={v}" for k, v in event["args"].items())
    return "<br>".join([f"<b>{event['name']}</b> · rank {event['rank']}", f"duration {_duration(seconds)}",
                        f"phase {event.get('phase', '')}"] + ([extra] if extra else []))


def timeline(run, *, ranks=None, phase=None, where=None, include_compute: bool = True,
             title: str | None = None) -> go.Figure:
    """A Gantt-style figure of the Run's spans: one lane per rank, communication above compute.

    ranks: only these ranks. phase: a phase name or prefix (or a tuple of them), e.g. "all_reduce/"
    keeps every all-reduce measurement. where: any predicate on an event dict. Time runs in
    milliseconds from the first span shown.
    """
    events = _selected(run, ranks, phase, where)
    if not include_compute:
        events = [e for e in events if e["cat"] == "comm"]
    t0 = min((e["start"] for e in events), default=0.0)
    shown_ranks = sorted({e["rank"] for e in events} | (set(ranks) if ranks is not None else set(run.ranks)))
    lanes = ["comm"] + (["compute"] if any(e["cat"] != "comm" for e in events) else [])
    order = [lane_name(r, lane) for r in shown_ranks for lane in lanes]

    groups: dict[tuple, list] = {}  # (category, name, impl) -> spans, one trace each
    for e in events:
        impl = e["args"].get("impl", "backend") if e["cat"] == "comm" else ""
        groups.setdefault((e["cat"] == "comm", e["name"], impl), []).append(e)

    fig = go.Figure()
    compute_names = sorted({name for (is_comm, name, _) in groups if not is_comm})
    for (is_comm, name, impl), spans in sorted(groups.items(), key=lambda item: (not item[0][0], item[0][1:])):
        if is_comm:
            colour, label = colour_of(name), name if impl == "backend" else f"{name} ({impl})"
            pattern = dict(shape="" if impl == "backend" else HANDWRITTEN_PATTERN)
            hover = [comm_hover(e) for e in spans]
        else:
            colour = COMPUTE_COLOURS[compute_names.index(name) % len(COMPUTE_COLOURS)]
            label, pattern, hover = name, dict(shape=""), [compute_hover(e) for e in spans]
        fig.add_trace(go.Bar(
            orientation="h", name=label, legendgroup="comm" if is_comm else "compute",
            legendgrouptitle_text="communication" if is_comm else "compute",
            y=[lane_name(e["rank"], "comm" if is_comm else "compute") for e in spans],
            base=[(e["start"] - t0) * 1e3 for e in spans],
            x=[max(e["end"] - e["start"], 0.0) * 1e3 for e in spans],
            marker=dict(color=colour, line=dict(width=0), pattern=pattern),
            hovertext=hover, hoverinfo="text"))
    fig.update_layout(
        title=title or f"Timeline: {len(shown_ranks)} ranks, {sum(e['cat'] == 'comm' for e in events)} "
                       f"collective calls",
        barmode="overlay", bargap=0.25, height=120 + 34 * len(order), template="plotly_white",
        xaxis_title="time since the first span (ms)", legend=dict(groupclick="toggleitem"),
        yaxis=dict(categoryorder="array", categoryarray=order, autorange="reversed", title=None),
        margin=dict(l=10, r=10, t=60, b=40))
    return fig
