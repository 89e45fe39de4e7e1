"""The pipeline's two prices, as formulas and as measured: idle time (the bubble) and activation memory.

Bubble: the fraction of a step a rank's compute stream is idle. With p stages, m micro-batches, a forward
costing F and a backward B (+ W, its weight part, when split):

    GPipe, 1F1B    (p - 1) / (m + p - 1)                   (Huang et al. 2019; the same for both)
    interleaved    (p - 1) / (v·m + p - 1)                 v stages per rank (Narayanan et al. 2021, §2.2)
    ZB-H1          (p - 1)(F + B - W) / (m(F + B + W) + (p - 1)(F + B - W))     (Qi et al. 2024, §2.1)

Activations: the micro-batches whose forward has run and whose backward has not yet freed them:

    GPipe          m on every stage
    1F1B           min(m, p - r) on stage r: p on the first, 1 on the last
    ZB-H1          as 1F1B until B; counting until W, p on every stage (what W still needs is a part of a
                   micro-batch's activations, so no stage holds more bytes than 1F1B's first)
    interleaved    Megatron-LM's warm-up + 1 forwards, in stages of 1/v the layers each: (p - r - 1)·2 + (v - 1)·g + 1,
                   g the micro-batches a group sends through a rank's stages together (p when p divides m)

`in_flight(actions)` counts it from any schedule's list, `formula_bubble` and `formula_in_flight` give the
closed forms; `measured_bubble(run)` reads a real (or simulated) Run's action spans, and `ideal_run`
turns a dry run (`lowering.replay`) into a Run, so the same figure draws the textbook diagram.

Why a real bubble is not the formula's, measured: `replayed_bubble(run, programs)` replays the step's own
programs with its actions' measured durations and free messages (the schedule's bubble with these stages, whose
actions do not cost F = 1, B = 2), and `step_breakdown(run)` splits each rank's real step into its actions, its
waits for messages, and the rest (sending and posting them, the loss's all-reduce, Python between actions).
"""

from __future__ import annotations

from .schedules import KINDS, Action, group_size


def formula_bubble(
    schedule: str, pp: int, microbatches: int, virtual_stages: int = 1, costs: dict | None = None
) -> float:
    """The textbook bubble fraction of `schedule` (costs {"F", "B", "W"}: ZB-H1 only; default 1, 1, 1)."""
    p, m, v = pp, microbatches, virtual_stages
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if schedule == "zb-h1":
        c = {"F": 1.0, "B": 1.0, "W": 1.0, **(costs or {})}
        idle = (p - 1) * (c["F"] + c["B"] - c["W"])
        return idle / (m * (c["F"] + c["B"] + c["W"]) + idle)
    raise ValueError(f"no formula for schedule {schedule!r}; schedules: gpipe, 1f1b, interleaved, zb-h1.")


def formula_in_flight(schedule: str, pp: int, microbatches: int, rank: int, virtual_stages: int = 1) -> int:
    """Micro-batches (interleaved: stages' worth of micro-batches) whose activations rank `rank` holds at once
    (ZB-H1: counting a micro-batch until its W)."""
    p, m, v = pp, microbatches, virtual_stages
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, p - rank)
    if schedule == "zb-h1":
        return min(m, p)
    if schedule == "interleaved":
        return min(m * v, (p - rank - 1) * 2 + (v - 1) * group_size(p, m) + 1)
    raise ValueError(f"no formula for schedule {schedule!r}; schedules: gpipe, 1f1b, interleaved, zb-h1.")


def in_flight(actions: list[Action]) -> int:
    """The most micro-batches one rank's actions hold at once: forwards run, not yet finished backward (W
    when the schedule splits it, else B)."""
    done_kind = "W" if any(a.kind == "W" for a in actions) else "B"
    live = peak = 0
    for a in actions:
        live += (a.kind == "F") - (a.kind == done_kind)
        peak = max(peak, live)
    return peak


def _actions(run, step: int | None) -> list[dict]:
    spans = [e for e in run.events if e["cat"] == "compute" and "action" in e["args"]]
    if not spans:
        raise ValueError("this Run has no pipeline actions (spans with args 'action'): was it trained with pp > 1?")
    step = max(e["args"].get("step", 0) for e in spans) if step is None else step
    return [e for e in spans if e["args"].get("step", 0) == step]


def _busy(spans) -> dict:
    busy: dict = {}
    for e in spans:
        busy[e["rank"]] = busy.get(e["rank"], 0.0) + e["end"] - e["start"]
    return dict(sorted(busy.items()))


def measured_bubble(run, step: int | None = None) -> dict:
    """{rank: idle fraction} of one step of a Run (default: its last), from the pipeline's action spans
    (forward, backward, weight gradients: args "action"). The step runs from the first action's start on any
    rank to the last one's end; a rank's busy time is the sum of its actions' spans."""
    spans = _actions(run, step)
    start, end = min(e["start"] for e in spans), max(e["end"] for e in spans)
    return {rank: 1.0 - b / (end - start) for rank, b in _busy(spans).items()}


def replayed_bubble(run, programs: list[list], step: int | None = None) -> dict:
    """{rank: idle fraction} of the step replayed (`lowering.replay`) with each action's measured duration and free
    messages: the bubble the schedule itself leaves with these stages, a lower bound of the measured one."""
    from .lowering import busy_and_span, replay

    took = {
        (e["args"]["action"], e["args"]["micro"], e["args"]["stage"]): e["end"] - e["start"]
        for e in _actions(run, step)
    }
    busy, span = busy_and_span(replay(programs, lambda a: took[(a.kind, a.micro, a.stage)]))
    return {rank: 1.0 - b / span for rank, b in enumerate(busy)}


def step_breakdown(run, step: int | None = None) -> dict:
    """{rank: {"actions", "waiting", "between"}}: each rank's share of the step (the span `measured_bubble` uses) in
    its actions, blocked waiting for a message (the mailbox's "wait" spans), and the rest: sending and posting
    messages, the loss's all-reduce, Python between actions. The three add up to 1; "actions" is 1 - the bubble."""
    spans = _actions(run, step)
    start, end = min(e["start"] for e in spans), max(e["end"] for e in spans)
    waits: dict = {}
    for e in run.events:  # point-to-point waits only (a collective's, inside an action, is the action's time)
        if e["cat"] == "wait" and e["args"].get("op") in ("send", "recv") and e["end"] > start and e["start"] < end:
            waits[e["rank"]] = waits.get(e["rank"], 0.0) + min(e["end"], end) - max(e["start"], start)
    out = {}
    for rank, busy in _busy(spans).items():
        actions, waiting = busy / (end - start), waits.get(rank, 0.0) / (end - start)
        out[rank] = {"actions": actions, "waiting": waiting, "between": 1.0 - actions - waiting}
    return out


def message_latency(run, step: int | None = None) -> list[float]:
    """Seconds each message of the step took from its send to the end of its receiver's wait, for the messages
    whose receiver was already waiting when it was sent (so the wait ended when the data arrived)."""
    spans = _actions(run, step)
    start, end = min(e["start"] for e in spans), max(e["end"] for e in spans)
    sends = [e for e in run.events if e["name"] == "send" and start <= e["start"] <= end]
    waits = [e for e in run.events if e["cat"] == "wait" and e["args"].get("op") == "recv" and start <= e["end"] <= end]
    out = []
    for send in sends:
        peer = send["args"]["peer"]
        waited = [w for w in waits if w["rank"] == peer and w["start"] <= send["start"] < w["end"]]
        if waited:
            out.append(waited[0]["end"] - send["start"])
    return out


def ideal_run(timeline: list[list[tuple]], config: dict | None = None):
    """A Run of a dry run's timeline (`lowering.replay`): the textbook diagram, drawn like a measured Run."""
    from ...run import Run
    from .lowering import Send

    events = []
    for rank, ops in enumerate(timeline):
        for op, start, end in ops:
            if isinstance(op, Action):
                events.append(
                    {
                        "name": KINDS[op.kind],
                        "cat": "compute",
                        "phase": "forward" if op.kind == "F" else "backward",
                        "rank": rank,
                        "start": start,
                        "end": end,
                        "args": {"step": 0, "micro": op.micro, "stage": op.stage, "action": op.kind},
                    }
                )
            elif isinstance(op, Send):
                events.append(
                    {
                        "name": "send",
                        "cat": "comm",
                        "phase": "",
                        "rank": rank,
                        "start": start,
                        "end": end,
                        "args": {
                            "message": op.message.kind,
                            "micro": op.message.micro,
                            "stage": op.message.stage,
                            "peer": op.peer,
                        },
                    }
                )
    events.sort(key=lambda e: (e["start"], e["rank"]))
    return Run(
        dict(config or {}, ideal=True),
        events,
        [],
        [],
        {"world_size": len(timeline), "ranks": list(range(len(timeline)))},
    )
