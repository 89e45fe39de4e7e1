"""The timeline: what every rank was doing, and when, drawn from a Run's spans.

One lane per rank, split into two sub-lanes: communication on top, compute under it, so a glance
shows whether a rank computed while its collectives were in flight (overlap) or waited for them.
Colours are `style`'s, one per meaning: communication by operation (hatched when a hand-written
implementation, ring or pairwise, ran it instead of the backend), compute by category (forward,
backward, optimizer, experts, wait). Hovering a span tells its size, the bytes this rank sent and
received, its duration and the bandwidth it achieved.

Honest about blocking: a synchronous collective issued inside a compute span (naive data parallelism
all-reduces at the end of backward, inside the backward span) leaves the rank waiting, not computing.
The compute lane shows that time as "blocked in <operation>", in the colour of waiting, on top of the
span it interrupts, and the subtitle gives the share of communication time that really overlapped
computation (`toolkit.trace.analysis.overlap_fraction`, the number the tables report).

A pure function of a Run: it draws what was recorded and runs nothing.
"""

from __future__ import annotations

import plotly.graph_objects as go

from ..comm.measure import bus_factor
from ..comm.measure_table import size_label
from ..trace.analysis import _intersection, _union, overlap_fraction
from ..units import bandwidth_text
from . import style

LANES = ("comm", "compute")
BLOCKED = style.BLOCKED
UNITS = " · units"  # "forward · units": every unit's span of a pass, one colour, each bar named, edges drawn


def lane_name(rank: int, lane: str) -> str:
    return f"rank {rank} · {'comm' if lane == 'comm' else 'compute'}"


def unit_of(name: str):
    """("forward", "blocks.3") for a sharded unit's span ("forward blocks.3", "backward (root)"); else None."""
    word, _, unit = str(name).partition(" ")
    return (word, unit) if word in ("forward", "backward") and unit else None


def _compute_label(event) -> str:
    """The legend's name of a compute-lane span: its own, except the emulated link's waits and the units of
    FSDP / ZeRO-3 ("forward blocks.3"), which share one name per pass, each bar labelled with its unit."""
    if event["cat"] == "blocked":
        return event["name"]
    if unit_of(event["name"]):
        return unit_of(event["name"])[0] + UNITS
    return style.LABELS["emulated"] if style.compute_category(event) == "emulated" else event["name"]


def blocked_spans(events) -> list[dict]:
    """Where a synchronous collective ran inside a compute span of the same rank: the rank waited there.
    One span per piece, on the compute lane, named "blocked in <operation>"."""
    out = []
    for rank in sorted({e["rank"] for e in events}):
        compute = _union(
            (e["start"], e["end"])
            for e in events
            if e["rank"] == rank and e["cat"] not in ("comm", "wait") and e["end"] is not None
        )
        for e in events:
            if e["rank"] == rank and e["cat"] == "comm" and e["args"].get("async_op") is False:
                for start, end in _intersection([(e["start"], e["end"])], compute):
                    out.append(
                        {
                            "name": BLOCKED + style.operation_of(e["name"]),
                            "cat": "blocked",
                            "rank": rank,
                            "start": start,
                            "end": end,
                            "phase": e.get("phase", ""),
                            "args": {"collective": e["name"], "impl": e["args"].get("impl", "?")},
                        }
                    )
    return out


def _selected(run, ranks, phase, where):
    prefixes = (phase,) if isinstance(phase, str) else tuple(phase) if phase is not None else None
    keep = set(ranks) if ranks is not None else None
    return [
        e
        for e in run.events
        if (keep is None or e["rank"] in keep)
        and (prefixes is None or str(e.get("phase", "")).startswith(prefixes))
        and (where is None or where(e))
    ]


def _bandwidth(nbytes: float, seconds: float) -> str:
    return bandwidth_text(nbytes / seconds) if seconds > 0 else "n/a"


def _duration(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} µs" if seconds * 1e6 < 999.5 else f"{seconds * 1e3:.3f} ms"


def comm_hover(event) -> str:
    """The hover text of one communication span: what moved, how long it took, how fast that was."""
    a, seconds = event["args"], max(event["end"] - event["start"], 0.0)
    size = a.get("size_bytes", 0)
    lines = [
        f"<b>{event['name']}</b> ({a.get('impl', '?')}) · rank {event['rank']}",
        f"size {size_label(size)} ({a.get('numel', '?')} × {a.get('dtype', '?')})",
        f"sent {size_label(a.get('bytes_sent', 0))} · received {size_label(a.get('bytes_recv', 0))}",
        f"duration {_duration(seconds)}",
    ]
    if size and seconds > 0:
        bw = f"algbw {_bandwidth(size, seconds)}"
        group = a.get("group") or []
        try:
            bw += f" · busbw {_bandwidth(size * bus_factor(event['name'], len(group)), seconds)}"
        except ValueError:  # send, recv, barrier: no bus factor
            pass
        lines.append(bw)
    lines.append(f"phase {event.get('phase', '')} · group {a.get('group', '?')}")
    return "<br>".join(lines)


def compute_hover(event) -> str:
    seconds = max(event["end"] - event["start"], 0.0)
    if event["cat"] == "blocked":
        return "<br>".join(
            [
                f"<b>{event['name']}</b> · rank {event['rank']}",
                f"duration {_duration(seconds)}",
                "a synchronous collective inside this compute span: the rank waited, it did not compute",
                f"phase {event.get('phase', '')}",
            ]
        )
    extra = ", ".join(f"{k}={v}" for k, v in event["args"].items())
    return "<br>".join(
        [
            f"<b>{event['name']}</b> · rank {event['rank']}",
            f"duration {_duration(seconds)}",
            f"phase {event.get('phase', '')}",
        ]
        + ([extra] if extra else [])
    )


def _overlap_line(run, events, blocked) -> str:
    """The subtitle: how much of the communication shown hid behind computation, and why not more."""
    working = ("forward", "backward", "optimizer", "experts")
    if not any(e["cat"] == "comm" for e in events) or not any(
        e["cat"] != "comm" and style.compute_category(e) in working for e in events
    ):
        return ""  # nothing but collectives (a measurement): overlap means nothing here
    share = overlap_fraction(type(run)(run.config, events, meta=run.meta))
    line = f"communication overlapped with computation: {share:.0%} of its time"
    if blocked:
        line += " · grey on a compute lane: blocked in a synchronous collective (waiting, not computing)"
    return line


def timeline(
    run,
    *,
    ranks=None,
    phase=None,
    where=None,
    include_compute: bool = True,
    title: str | None = None,
    subtitle: str | None = None,
    note: str | None = None,
) -> go.Figure:
    """A Gantt-style figure of the Run's spans: one lane per rank, communication above compute.

    ranks: only these ranks. phase: a phase name or prefix (or a tuple of them), e.g. "all_reduce/"
    keeps every all-reduce measurement. where: any predicate on an event dict. Time runs in
    milliseconds from the first span shown. subtitle: a second title line (default: the overlap of
    the spans shown, and what grey means when a synchronous collective interrupted compute). note: a
    sentence added to the subtitle (e.g. how the spans shown relate to a table's numbers beside it).
    """
    events = _selected(run, ranks, phase, where)
    if not include_compute:
        events = [e for e in events if e["cat"] == "comm"]
    events = [e for e in events if e["end"] is not None]
    blocked = blocked_spans(events)
    t0 = min((e["start"] for e in events), default=0.0)
    shown_ranks = sorted({e["rank"] for e in events} | (set(ranks) if ranks is not None else set(run.ranks)))
    lanes = ["comm"] + (["compute"] if any(e["cat"] != "comm" for e in events) else [])
    order = [lane_name(r, lane) for r in shown_ranks for lane in lanes]

    groups: dict[tuple, list] = {}  # (is comm, label, impl) -> spans, one trace each
    for e in events + blocked:
        is_comm = e["cat"] == "comm"
        impl = e["args"].get("impl", "backend") if is_comm else ""
        groups.setdefault((is_comm, e["name"] if is_comm else _compute_label(e), impl), []).append(e)

    fig = go.Figure()
    drawing_order = sorted(groups, key=lambda k: (not k[0], k[1].startswith(BLOCKED), k[1], k[2]))
    for is_comm, label, impl in drawing_order:  # communication, then compute, blocked time on top
        spans = groups[(is_comm, label, impl)]
        if is_comm:
            name = label if impl == "backend" else f"{label} ({impl})"
            pattern = dict(shape="" if impl == "backend" else style.HANDWRITTEN_PATTERN)
            hover = [comm_hover(e) for e in spans]
        else:
            name, pattern, hover = label, dict(shape=""), [compute_hover(e) for e in spans]
        units = not is_comm and label.endswith(UNITS)  # near-identical shades per unit would not tell them apart:
        text = [unit_of(e["name"])[1] for e in spans] if units else None  # a name on each bar, and its edges
        fig.add_trace(
            go.Bar(
                orientation="h",
                name=name,
                legendgroup="comm" if is_comm else "compute",
                legendgrouptitle_text="communication" if is_comm else "compute",
                y=[lane_name(e["rank"], "comm" if is_comm else "compute") for e in spans],
                base=[(e["start"] - t0) * 1e3 for e in spans],
                x=[max(e["end"] - e["start"], 0.0) * 1e3 for e in spans],
                marker=dict(
                    color=(style.comm_colour if is_comm else style.compute_colour)(label),
                    line=dict(width=1.5 if units else 0.5, color=style.SEPARATOR),
                    pattern=pattern,
                ),
                text=text,
                textposition="inside" if units else None,
                insidetextanchor="middle",
                textfont=dict(color=style.SEPARATOR) if units else None,
                hovertext=hover,
                hoverinfo="text",
            )
        )
    calls = sum(e["cat"] == "comm" for e in events)
    style.place_title(
        fig,
        title or f"Timeline: {len(shown_ranks)} ranks, {calls} collective calls",
        " · ".join(t for t in (subtitle if subtitle is not None else _overlap_line(run, events, blocked), note) if t),
    )
    legend_px = 20 * (len(groups) + 2)  # one line per name and per group title: the lanes make room for it
    fig.update_layout(
        barmode="overlay",
        bargap=0.25,
        uniformtext=dict(minsize=8, mode="hide"),  # a unit's name where it fits
        height=fig.layout.margin.t + 80 + max(34 * len(order), legend_px),
        template="plotly_white",
        xaxis_title="time since the first span (ms)",
        legend=dict(groupclick="toggleitem"),
        yaxis=dict(categoryorder="array", categoryarray=order, autorange="reversed", title=None),
        margin=dict(l=10, r=10, b=40),
    )
    return fig
