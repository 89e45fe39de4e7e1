"""From a schedule's actions to what each rank runs: the sends and receives put in, and a dry run.

A schedule says only F, B and W (`schedules.py`). What moves between ranks follows from it:

    F of micro-batch i on stage s    receive the activation of (i, s-1) first;  send the activation of (i, s) after
    B of micro-batch i on stage s    receive the gradient of (i, s+1) first;    send the gradient of (i, s) after
    tied weights (a GPT's embedding, reused as its head on the last stage): the first stage sends the weight
    to the last after its first forward, and the last stage sends the head's gradient back after its last
    backward, before the first stage's last weight-gradient action needs it (`stage.py`).

Sends never block (isend); a receive blocks until its data is there. Between two ranks messages are
taken in the order they were sent (NCCL matches point-to-point calls in order; gloo's tags would allow
otherwise, NCCL's would not), so a rank that needs a later message first keeps the earlier ones in a
mailbox (`p2p.py`). Under these rules a schedule either runs or deadlocks, and `replay` finds out which
without running anything: every rank steps through its program on a clock (F, B, W costing what
`cost` says), a receive waits for its send; if no rank can move and work remains, it names where every
rank waits. With unit costs the replay is the classic diagram, and its idle time the bubble formulas.
"""

from __future__ import annotations

from typing import NamedTuple

from .schedules import Action, splits_backward


class Message(NamedTuple):
    """What one send carries: `kind` ("activation", "gradient", "tied weight", "tied gradient") of `micro`
    from `stage`."""

    kind: str
    micro: int
    stage: int

    def __repr__(self) -> str:
        return (
            f"{self.kind} of micro-batch {self.micro} from stage {self.stage}"
            if self.micro >= 0
            else f"{self.kind} from stage {self.stage}"
        )


class Send(NamedTuple):
    message: Message
    peer: int


class Recv(NamedTuple):
    message: Message
    peer: int


class PipelineDeadlock(RuntimeError):
    """The schedule cannot finish: every rank with work left waits for a message that is never sent first."""


def lower(actions: list[list[Action]], pp: int, tied: bool = False) -> list[list]:
    """Each rank's program: its actions with the Send and Recv each one needs, in order."""
    stages = max(a.stage for mine in actions for a in mine) + 1
    split = splits_backward(actions)
    weight_kind = "W" if split else "B"  # the action in which weight gradients accumulate
    last_stage = stages - 1

    def rank_of(stage: int) -> int:
        return stage % pp

    programs = []
    for mine in actions:
        first_forward = {s: next((a for a in mine if a.kind == "F" and a.stage == s), None) for s in (0, last_stage)}
        # the first stage adds the head's gradient to its own in its last weight-gradient action; the last stage
        # has it after its last B (its copy of the tied weight gets its gradient in B, with the input's)
        last_weights = {
            0: next((a for a in reversed(mine) if a.kind == weight_kind and a.stage == 0), None),
            last_stage: next((a for a in reversed(mine) if a.kind == "B" and a.stage == last_stage), None),
        }
        ops: list = []
        for a in mine:
            if a.kind == "F":
                if a.stage > 0:
                    ops.append(Recv(Message("activation", a.micro, a.stage - 1), rank_of(a.stage - 1)))
                if tied and a.stage == last_stage and a == first_forward[last_stage]:
                    ops.append(Recv(Message("tied weight", -1, 0), rank_of(0)))
                ops.append(a)
                if a.stage < last_stage:
                    ops.append(Send(Message("activation", a.micro, a.stage), rank_of(a.stage + 1)))
                if tied and a.stage == 0 and a == first_forward[0]:
                    ops.append(Send(Message("tied weight", -1, 0), rank_of(last_stage)))
                continue
            if a.kind == "B" and a.stage < last_stage:
                ops.append(Recv(Message("gradient", a.micro, a.stage + 1), rank_of(a.stage + 1)))
            if tied and a.stage == 0 and a == last_weights[0]:
                ops.append(Recv(Message("tied gradient", -1, last_stage), rank_of(last_stage)))
            ops.append(a)
            if a.kind == "B" and a.stage > 0:
                ops.append(Send(Message("gradient", a.micro, a.stage), rank_of(a.stage - 1)))
            if tied and a.stage == last_stage and a == last_weights[last_stage]:
                ops.append(Send(Message("tied gradient", -1, last_stage), rank_of(0)))
        programs.append(ops)
    return programs


def send_order(programs: list[list]) -> dict:
    """{(sender, receiver): [Message, ...]} in the order each rank sends them: the order they are received in."""
    order: dict = {}
    for rank, ops in enumerate(programs):
        for op in ops:
            if isinstance(op, Send):
                order.setdefault((rank, op.peer), []).append(op.message)
    return order


def unit_cost(split: bool, virtual_stages: int = 1):
    """The textbook's durations: a stage's forward 1, its backward 2 (split: B 1 and W 1, Qi et al.'s T_B = T_W);
    with v stages per rank each holds 1/v of a rank's layers, so its actions cost 1/v."""
    costs = {"F": 1.0, "B": 1.0 if split else 2.0, "W": 1.0}
    return lambda action: costs[action.kind] / virtual_stages


def replay(programs: list[list], cost) -> list[list[tuple]]:
    """Run every rank's program on a clock without running anything: [(op, start, end), ...] per rank.

    cost(action) -> seconds. A Send takes no time and makes its message available at that moment; a
    Recv waits for it. Raises PipelineDeadlock naming every rank's waiting op if no rank can move."""
    sent: dict = {}  # (sender, receiver, message) -> time
    clocks = [0.0] * len(programs)
    done: list[list[tuple]] = [[] for _ in programs]
    position = [0] * len(programs)
    while any(position[r] < len(ops) for r, ops in enumerate(programs)):
        moved = False
        for rank, ops in enumerate(programs):
            while position[rank] < len(ops):
                op = ops[position[rank]]
                if isinstance(op, Recv):
                    key = (op.peer, rank, op.message)
                    if key not in sent:
                        break
                    start = max(clocks[rank], sent.pop(key))
                    done[rank].append((op, clocks[rank], start))
                    clocks[rank] = start
                elif isinstance(op, Send):
                    sent[(rank, op.peer, op.message)] = clocks[rank]
                    done[rank].append((op, clocks[rank], clocks[rank]))
                else:
                    end = clocks[rank] + cost(op)
                    done[rank].append((op, clocks[rank], end))
                    clocks[rank] = end
                position[rank] += 1
                moved = True
        if not moved:
            raise PipelineDeadlock(explain_deadlock(programs, position, done))
    if sent:
        raise PipelineDeadlock(f"messages sent and never received: {sorted(map(str, sent))[:4]}")
    return done


def explain_deadlock(programs: list[list], position: list[int], done: list[list]) -> str:
    """Where every rank waits, and for what: the sentence a student needs to find the wrong order."""
    lines = []
    for rank, ops in enumerate(programs):
        if position[rank] >= len(ops):
            lines.append(f"rank {rank} has finished")
            continue
        op = ops[position[rank]]
        action = next((o for o in ops[position[rank] :] if isinstance(o, Action)), None)
        last = next((o for o, *_ in reversed(done[rank]) if isinstance(o, Action)), None)
        after = f" (after {last!r})" if last is not None else " (before any action)"
        lines.append(f"rank {rank} waits at {action!r}{after} to receive the {op.message!r} (rank {op.peer})")
    return (
        "the pipeline schedule deadlocks: every rank with work left waits to receive a message that its "
        "sender sends only after something it is itself waiting for.\n  "
        + "\n  ".join(lines)
        + "\nAction names read <stage><F|B|W><micro-batch>. Check the order of each rank's actions: a backward "
        "needs the next stage's backward of the same micro-batch first, a forward the previous stage's forward."
    )


def busy_and_span(timeline: list[list[tuple]]) -> tuple[list[float], float]:
    """(compute time per rank, the step's length) of a replay."""
    busy = [sum(end - start for op, start, end in ops if isinstance(op, Action)) for ops in timeline]
    span = max((end for ops in timeline for _, _, end in ops), default=0.0)
    return busy, span
