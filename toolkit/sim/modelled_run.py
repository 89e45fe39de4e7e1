"""A priced simulation as a Run: the modelled timeline with the spans a real run's trace has.

The Run has the same spans as a real one, in the same order: "forward", "backward" and "optimizer"
compute spans, the strategy's own spans (an FSDP unit's pass, a MoE layer's experts), one span per
collective with the door's args, and a "wait" span wherever the compute stream stalls on an
asynchronous collective; every event says `args.modelled=True`. So `toolkit.viz.timeline`,
`toolkit.trace.analysis` and the Chrome export treat it as a real run.
"""

from __future__ import annotations

import platform

import torch

from ..run import Run
from .hardware import Cluster
from .timeline import Timeline


def _compute_events(timeline: Timeline, step: int) -> list[dict]:
    """One compute span per run of consecutive instructions in one phase, as the training loop records
    "forward", "backward", "optimizer" (a phase's span covers the stalls inside it, as a real one does)."""
    events = []
    for s in timeline.spans:
        if s.kind == "comm":
            continue
        phase = s.instruction.phase
        last = events[-1] if events else None
        if last is not None and last["phase"] == phase:
            last["end"] = s.end
        else:
            last = {
                "name": phase,
                "cat": "compute",
                "phase": phase,
                "start": s.start,
                "end": s.end,
                "args": {"modelled": True, "step": step, "flops": 0.0, "segments": 0},
            }
            events.append(last)
        if s.kind == "compute":
            last["args"]["flops"] += s.instruction.flops
            last["args"]["segments"] += 1
    return events + _span_events(timeline, step)


def _span_events(timeline: Timeline, step: int) -> list[dict]:
    """The strategy's own spans (an FSDP unit's forward, a MoE layer's experts, with their args), each from its
    first segment's start to its last one's end, as a real trace has them inside the phase's span."""
    spans: dict = {}
    for s in timeline.spans:
        if s.kind != "compute":
            continue
        for key, name, cat, args in s.instruction.spans:
            if name == s.instruction.phase and "action" not in args:  # the loop's own phases: above (a pipeline's
                continue  # actions are spans of their own)
            if key in spans:
                spans[key]["end"] = s.end
                spans[key]["args"]["flops"] += s.instruction.flops
            else:
                spans[key] = {
                    "name": name,
                    "cat": cat,
                    "phase": s.instruction.phase,
                    "start": s.start,
                    "end": s.end,
                    "args": dict(args, modelled=True, step=step, flops=s.instruction.flops),
                }
    return list(spans.values())


def _comm_event(s, step: int) -> dict:
    c = s.instruction
    args = dict(
        c.args,
        group=list(c.group),
        size_bytes=c.size_bytes,
        bytes_sent=c.bytes_sent,
        bytes_recv=c.bytes_recv,
        async_op=c.async_op,
        impl=c.args.get("impl", "backend"),
        modelled=True,
        step=step,
        link=s.cost.link,
        modelled_s=s.end - s.start,
        queued_s=s.start - s.issued,
        issue_order=c.id,
    )
    if c.label:
        args["label"] = c.label  # the unit, MoE step or module that issued it (the door's own args stay as they were)
    return {"name": c.op, "cat": "comm", "phase": c.phase, "start": s.start, "end": s.end, "args": args}


def _wait_events(timeline: Timeline, step: int) -> list[dict]:
    """A "wait" span where compute stalls on an asynchronous collective, or runs its copies on the cores
    ("host", overlap < 1: not computing either, args.host=True). A synchronous one's own span, async_op=False,
    already says the rank was blocked, as in a real trace."""
    ops = {s.instruction.id: s.instruction for s in timeline.spans if s.kind == "comm"}
    return [
        {
            "name": "wait",
            "cat": "wait",
            "phase": s.instruction.phase,
            "start": s.start,
            "end": s.end,
            "args": {
                "op": ops[s.instruction.id].op,
                "modelled": True,
                "step": step,
                **({"host": True} if s.kind == "host" else {}),
            },
        }
        for s in timeline.spans
        if s.kind in ("wait", "host") and ops[s.instruction.id].async_op
    ]


def modelled_run(timelines, cluster: Cluster, *, rank: int = 0, world_size: int = 1, config: dict | None = None) -> Run:
    """The timelines of one rank's steps as a Run (events marked modelled), with a "step_time" metric per step."""
    events, metrics = [], []
    for step, timeline in enumerate(timelines):
        events += _compute_events(timeline, step)
        events += [_comm_event(s, step) for s in timeline.spans if s.kind == "comm"]
        events += _wait_events(timeline, step)
        metrics.append({"name": "step_time", "step": step, "value": timeline.step_time, "rank": rank})
        metrics.append({"name": "modelled_breakdown", "step": step, "value": timeline.breakdown(), "rank": rank})
    for e in events:
        e["rank"] = rank
    events.sort(key=lambda e: (e["start"], e["cat"] != "compute"))
    meta = {
        "world_size": world_size,
        "ranks": [rank],
        "backend": "simulated",
        "device": cluster.gpu.name,
        "torch": torch.__version__,
        "host": platform.node(),
        "clock_offset_s": 0.0,
        "emulated_link": None,
        "modelled": True,
        "cluster": cluster.describe(),
    }
    return Run(dict(config or {}, kind="simulated"), events, [], metrics, meta)
