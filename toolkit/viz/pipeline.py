"""The pipeline's timeline: ranks down, time across, one block per action, coloured by micro-batch.

The classic diagram of GPipe and 1F1B papers, drawn from a Run: a real one (`toolkit.train` under pp > 1),
a simulated one, or the dry run of a schedule (`toolkit.parallel.pipeline.bubble.ideal_run`, unit costs).
Each action is a block labelled like the schedule prints it, F3 / B3 / W3 (stage in the hover): micro-batch i
has the i-th colour of `style.SEQUENCE`, its forward in that colour, its backward darker, its weight-gradient
pass (zero-bubble schedules) lighter. An arrow joins the action that produced each activation or gradient to
the one that used it on the next rank (what the send carried). The blank between blocks is the bubble; the
subtitle gives each rank's idle share of the step, measured, beside the schedule's formula when one is given.

A pure function of a Run: it reads the spans whose args carry "action" (the pipeline driver's), and runs nothing.
"""

from __future__ import annotations

import plotly.graph_objects as go

from . import style

SHADES = {"F": 0, "B": 2, "W": 1}  # forward: the micro-batch's colour; backward darker; weight gradients lighter
NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved 1F1B", "zb-h1": "ZB-H1"}


def actions_of(run, step: int | None = None) -> tuple[list[dict], int]:
    """The pipeline's action spans of one step (default: the Run's last), and that step."""
    spans = [e for e in run.events if e["cat"] == "compute" and "action" in e.get("args", {})]
    if not spans:
        raise ValueError(
            "this Run has no pipeline actions (spans with args 'action'): draw a Run trained with pp > 1, "
            "or a schedule's dry run (toolkit.parallel.pipeline.bubble.ideal_run)."
        )
    step = max(e["args"].get("step", 0) for e in spans) if step is None else step
    return [e for e in spans if e["args"].get("step", 0) == step], step


def schedule_of(run, spans: list[dict]) -> str:
    """The schedule as a title names it, with its shape: "Interleaved 1F1B, p = 4, m = 8, v = 2". The name is the
    Run's (its config's "schedule", or its options'), else read off the actions: W's (zero bubble), several stages
    on a rank (interleaved), every forward before any backward (GPipe), else 1F1B."""
    options = run.config.get("options") or {}
    name = run.config.get("schedule", options.get("schedule"))
    ranks = sorted({e["rank"] for e in spans})
    stages = {r: {e["args"]["stage"] for e in spans if e["rank"] == r} for r in ranks}
    v = max(len(s) for s in stages.values())
    if name is None:
        first_backward = {
            r: min((e["start"] for e in spans if e["rank"] == r and e["args"]["action"] != "F"), default=float("inf"))
            for r in ranks
        }
        name = (
            "zb-h1"
            if any(e["args"]["action"] == "W" for e in spans)
            else "interleaved"
            if v > 1
            else "gpipe"
            if all(e["start"] < first_backward[e["rank"]] for e in spans if e["args"]["action"] == "F")
            else "1f1b"
        )
    label = NAMES.get(name, name) if isinstance(name, str) else getattr(name, "__name__", "a custom schedule")
    m = len({e["args"]["micro"] for e in spans})
    return f"{label}, p = {len(ranks)}, m = {m}" + (f", v = {v}" if v > 1 else "")


def arrows_of(spans: list[dict]) -> list[tuple[dict, dict]]:
    """(producer, consumer) pairs: a forward feeds the next stage's forward of the same micro-batch, a backward
    the previous stage's backward (under a split backward, B produces the input's gradient)."""
    index = {(e["args"]["action"], e["args"]["micro"], e["args"]["stage"]): e for e in spans}
    pairs = []
    for (kind, micro, stage), e in index.items():
        target = {"F": ("F", micro, stage + 1), "B": ("B", micro, stage - 1)}.get(kind)
        if target in index and index[target]["rank"] != e["rank"]:
            pairs.append((e, index[target]))
    return pairs


def pipeline_timeline(
    run, step: int | None = None, *, formula: float | None = None, arrows: bool = True, title: str | None = None
) -> go.Figure:
    """The step's actions per rank, coloured by micro-batch, with arrows for what crossed between ranks.
    formula: the schedule's bubble fraction, printed beside the measured one."""
    from ..parallel.pipeline.bubble import measured_bubble

    spans, step = actions_of(run, step)
    start = min(e["start"] for e in spans)
    scale = 1.0 if run.config.get("ideal") else 1e3  # a dry run's units as they are; seconds as ms
    unit = "units (F = 1)" if run.config.get("ideal") else "ms"
    ranks = sorted({e["rank"] for e in spans})
    stages = {r: sorted({e["args"]["stage"] for e in spans if e["rank"] == r}) for r in ranks}
    row = {r: f"rank {r} · stage{'s' * (len(stages[r]) > 1)} {', '.join(map(str, stages[r]))}" for r in ranks}
    fig = go.Figure()
    for kind in ("F", "B", "W"):
        mine = [e for e in spans if e["args"]["action"] == kind]
        if not mine:
            continue
        colours = [style.shade(style.SEQUENCE[e["args"]["micro"] % len(style.SEQUENCE)], SHADES[kind]) for e in mine]
        fig.add_trace(
            go.Bar(
                name={"F": "forward", "B": "backward", "W": "weight gradients"}[kind],
                orientation="h",
                base=[(e["start"] - start) * scale for e in mine],
                x=[(e["end"] - e["start"]) * scale for e in mine],
                y=[row[e["rank"]] for e in mine],
                text=[f"{kind}{e['args']['micro']}" for e in mine],
                textposition="inside",
                insidetextanchor="middle",
                marker=dict(
                    color=colours,
                    line=dict(color=style.SEPARATOR, width=1),
                    pattern=dict(shape="/" if kind == "W" else ""),
                ),
                customdata=[[e["args"]["micro"], e["args"]["stage"], (e["end"] - e["start"]) * scale] for e in mine],
                hovertemplate=f"{kind} micro-batch %{{customdata[0]}}, stage %{{customdata[1]}}<br>"
                f"%{{customdata[2]:.3g}} {unit}<extra></extra>",
            )
        )
    if arrows:
        for producer, consumer in arrows_of(spans):
            fig.add_annotation(
                x=(consumer["start"] - start) * scale,
                y=row[consumer["rank"]],
                ax=(producer["end"] - start) * scale,
                ay=row[producer["rank"]],
                xref="x",
                yref="y",
                axref="x",
                ayref="y",
                showarrow=True,
                arrowhead=2,
                arrowsize=1,
                arrowwidth=1,
                arrowcolor=style.COMMUNICATION["send"],
                opacity=0.6,
                text="",
            )
    idle = measured_bubble(run, step)
    said = ", ".join(f"rank {r} {idle[r]:.0%}" for r in ranks)
    subtitle = (
        f"colour = micro-batch; F forward, B backward (darker), W weight gradients (lighter, hatched); arrows: "
        f"what was sent<br>bubble (idle share of the step): {said}"
        + (f"; the schedule's formula: {formula:.0%}" if formula is not None else "")
    )
    fig.update_layout(
        barmode="overlay",
        bargap=0.25,
        height=160 + 50 * len(ranks),
        showlegend=False,
        xaxis_title=f"time since the step's first action ({unit})",
        yaxis=dict(categoryorder="array", categoryarray=[row[r] for r in reversed(ranks)]),
    )
    when = "dry run" if run.config.get("ideal") else f"step {step}"
    return style.place_title(fig, title or f"{schedule_of(run, spans)} ({when}): one block per action", subtitle)
