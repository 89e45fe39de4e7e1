"""Pipeline schedules as data: for every rank, the list of actions it takes, in order.

An action is F (forward), B (backward) or W (weight gradients) of one micro-batch on one stage:

    Action("F", 3, 1)   forward of micro-batch 3 on stage 1          printed 1F3
    Action("B", 3, 1)   its backward: input and weight gradients    printed 1B3
                        (zero-bubble schedules: input gradients only, and W later computes the weights')

With `virtual_stages` v > 1 the model is cut into S = pp x v stages and rank r holds stages r, r + pp,
r + 2 pp, ... (Narayanan et al. 2021's interleaving); otherwise S = pp and rank r holds stage r.
Nothing else is decided here: the driver (`driver.py`) derives every send and receive from the order
of the actions (`lowering.py`), so the four schedules below are all that differs between them, and a
student can print them, draw them, or write one (labs/12-pipeline):

    gpipe        all forwards, then all backwards (Huang et al. 2019): m micro-batches' activations live
    1f1b         PipeDream-Flush (Narayanan et al. 2021): warm-up forwards, then one forward one backward,
                 then the cool-down backwards; at most pp - rank micro-batches' activations live
    interleaved  1F1B over v stages per rank (Megatron-LM's interleaved schedule): the bubble shrinks v-fold;
                 any m >= pp micro-batches, sent through a rank's stages in groups (Megatron-core's)
    zb-h1        1F1B with backward split into B (input gradient) and W (weight gradient), W's postponed
                 into the cool-down's idle time (Qi et al. 2024's ZB-H1): a third of 1F1B's bubble
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

KINDS = {"F": "forward", "B": "backward", "W": "weight gradients"}


class Action(NamedTuple):
    """One unit of a schedule: `kind` ("F", "B" or "W") of micro-batch `micro` on stage `stage`."""

    kind: str
    micro: int
    stage: int

    def __repr__(self) -> str:
        return f"{self.stage}{self.kind}{self.micro}"


def gpipe(pp: int, microbatches: int, rank: int, virtual_stages: int = 1) -> list[Action]:
    """GPipe: every micro-batch's forward, then every backward (in the same order, as torch's ScheduleGPipe)."""
    return [Action("F", i, rank) for i in range(microbatches)] + [Action("B", i, rank) for i in range(microbatches)]


def one_f_one_b(pp: int, microbatches: int, rank: int, virtual_stages: int = 1) -> list[Action]:
    """1F1B: pp - rank - 1 warm-up forwards; then forward one, backward one; then the remaining backwards.

    The last stage has no warm-up: it backs up each micro-batch as soon as it has run it forward, so it
    holds one micro-batch's activations; the first stage holds pp. GPipe's bubble, at a fraction of its memory."""
    warmup = min(pp - rank - 1, microbatches)
    actions = [Action("F", i, rank) for i in range(warmup)]
    for i in range(microbatches - warmup):  # steady state: the forward of micro-batch warmup + i, backward of i
        actions += [Action("F", warmup + i, rank), Action("B", i, rank)]
    actions += [Action("B", i, rank) for i in range(microbatches - warmup, microbatches)]  # cool-down
    return actions


def group_size(pp: int, microbatches: int) -> int:
    """How many micro-batches the interleaved schedule sends through a rank's stages together: pp when m is a
    multiple of pp, else the least g > pp whose last group (m mod g micro-batches) is empty or holds at least pp
    (Megatron-core's `microbatch_group_size_per_vp_stage`; a last group of fewer than pp would leave stages idle
    waiting on one another, which Megatron refuses). g = m always qualifies, so any m >= pp has one."""
    return next(g for g in range(pp, max(pp, microbatches) + 1) if microbatches % g == 0 or microbatches % g >= pp)


def interleaved(pp: int, microbatches: int, rank: int, virtual_stages: int = 2) -> list[Action]:
    """Megatron-LM's interleaved 1F1B: v stages per rank, micro-batches taken a group of g at a time.

    The micro-batches are cut into groups of g (`group_size`: pp, when pp divides m); a group goes through this
    rank's first stage, then its second, ... (Megatron-core's schedule table). Forward k (k = 0 .. v·m - 1) runs
    the k-th (micro-batch, stage) of that table; backward k the same micro-batch on the stages in reverse.
    Warm-up is (pp - rank - 1)·2 + (v - 1)·g forwards."""
    v, total, g = virtual_stages, microbatches * virtual_stages, group_size(pp, microbatches)
    groups = [range(first, min(first + g, microbatches)) for first in range(0, microbatches, g)]
    table = [(i, chunk) for group in groups for chunk in range(v) for i in group]  # (micro-batch, chunk), in order

    def forward(k: int) -> Action:
        micro, chunk = table[k]
        return Action("F", micro, chunk * pp + rank)

    def backward(k: int) -> Action:
        micro, chunk = table[k]
        return Action("B", micro, (v - 1 - chunk) * pp + rank)

    warmup = min((pp - rank - 1) * 2 + (v - 1) * g, total)
    actions = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [forward(warmup + k), backward(k)]
    actions += [backward(k) for k in range(total - warmup, total)]
    return actions


def zb_h1(pp: int, microbatches: int, rank: int, virtual_stages: int = 1) -> list[Action]:
    """ZB-H1: 1F1B's order of F and B, with B computing input gradients only and W the weights' later.

    B is on the critical path (the next stage upstream waits for its gradient), W is not. So rank r lets
    up to r W's wait in a queue: its B's, and the gradients they send upstream, go out earlier, and in the
    cool-down, where 1F1B sits idle between backwards, each B is followed by a waiting W. Every rank then
    holds at most pp micro-batches not yet finished (the first stage's count under 1F1B, where a W's
    inputs are part of what B would have kept), and the bubble drops from (pp - 1)(F + B + W) to
    (pp - 1)(F + B - W): a third of 1F1B's when the three cost the same (Qi et al. 2024, section 2.1)."""
    warmup = min(pp - rank - 1, microbatches)
    actions = [Action("F", i, rank) for i in range(warmup)]
    waiting: deque = deque()
    for i in range(microbatches - warmup):
        actions += [Action("F", warmup + i, rank), Action("B", i, rank)]
        waiting.append(i)
        if len(waiting) > rank:
            actions.append(Action("W", waiting.popleft(), rank))
    for i in range(microbatches - warmup, microbatches):  # cool-down: a waiting W fills each idle gap
        actions.append(Action("B", i, rank))
        waiting.append(i)
        actions.append(Action("W", waiting.popleft(), rank))
    actions += [Action("W", i, rank) for i in waiting]
    return actions


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zb-h1": zb_h1}
SPLIT_BACKWARD = {"zb-h1"}  # schedules whose B is input gradients only, with a W per micro-batch


def splits_backward(actions) -> bool:
    """True when a schedule's actions include W's (backward split into input and weight gradients)."""
    return any(a.kind == "W" for rank in actions for a in rank)


def resolve(schedule, virtual_stages: int):
    """The schedule function for a name (or a callable, as the lab's); an unknown name says the valid ones."""
    if callable(schedule):
        return schedule
    if schedule not in SCHEDULES:
        raise ValueError(
            f"unknown pipeline schedule {schedule!r}; choose one of {sorted(SCHEDULES)} "
            f"(or pass a function (pp, microbatches, rank, virtual_stages) -> list of Actions)."
        )
    if schedule == "interleaved" and virtual_stages < 2:
        raise ValueError(
            "schedule='interleaved' runs several stages per rank: pass virtual_stages=2 or more "
            "(with virtual_stages=1 it is plain 1F1B: schedule='1f1b')."
        )
    if schedule != "interleaved" and virtual_stages != 1:
        raise ValueError(
            f"virtual_stages={virtual_stages} needs schedule='interleaved'; schedule={schedule!r} "
            f"runs one stage per rank."
        )
    return SCHEDULES[schedule]


def build(schedule, pp: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """Every rank's actions (index = pipeline rank), checked (`check`)."""
    make = resolve(schedule, virtual_stages)
    actions = [[_as_action(a, make) for a in make(pp, microbatches, rank, virtual_stages)] for rank in range(pp)]
    check(actions, pp, microbatches, virtual_stages)
    return actions


def _as_action(a, make) -> Action:
    if isinstance(a, Action):
        return a
    if isinstance(a, tuple) and len(a) == 3:
        return Action(*a)
    raise TypeError(
        f"schedule {getattr(make, '__name__', make)!r} returned {a!r}; each action is an "
        f"Action(kind, micro, stage), e.g. Action('F', 0, rank)."
    )


def check(actions: list[list[Action]], pp: int, microbatches: int, virtual_stages: int = 1) -> None:
    """Every rank does, for each micro-batch of each of its stages, one F, then one B (then one W if the
    schedule splits backward), and nothing else. A mistake is a ValueError that names the rank and action."""
    split = splits_backward(actions)
    kinds = ("F", "B", "W") if split else ("F", "B")
    for rank, mine in enumerate(actions):
        stages = [rank + k * pp for k in range(virtual_stages)]
        done: set = set()
        for position, a in enumerate(mine):
            where = f"rank {rank}'s action {position} ({a!r})"
            if a.kind not in KINDS:
                raise ValueError(f"{where}: kind must be one of {list(KINDS)}, got {a.kind!r}.")
            if a.stage not in stages:
                raise ValueError(f"{where}: rank {rank} holds stage(s) {stages}, not stage {a.stage}.")
            if not 0 <= a.micro < microbatches:
                raise ValueError(f"{where}: micro-batches are numbered 0..{microbatches - 1}.")
            if a in done:
                raise ValueError(f"{where}: {KINDS[a.kind]} of micro-batch {a.micro} on stage {a.stage} appears twice.")
            before = {"B": "F", "W": "B"}.get(a.kind)
            if before and Action(before, a.micro, a.stage) not in done:
                raise ValueError(
                    f"{where}: {KINDS[a.kind]} of micro-batch {a.micro} comes before its "
                    f"{KINDS[before]} ({Action(before, a.micro, a.stage)!r}) on this rank."
                )
            done.add(a)
        missing = [
            Action(k, i, s) for s in stages for i in range(microbatches) for k in kinds if Action(k, i, s) not in done
        ]
        if missing:
            raise ValueError(
                f"rank {rank}'s schedule never runs {missing[:6]}{' ...' if len(missing) > 6 else ''}: "
                f"every micro-batch needs {' and '.join(KINDS[k] for k in kinds)} on every stage."
            )


def show(actions: list[list[Action]]) -> str:
    """The schedule as text, one line per rank: the classic diagram without the time axis."""
    return "\n".join(f"rank {r}: " + " ".join(map(repr, mine)) for r, mine in enumerate(actions))
