"""The graded checks of lab 10 (the cost model), judged in the grader's process. Pure functions: one rank runs
them all, and no message names a world size (the cases' N, 2 to 512 ranks, is in each message).

The expected values are numbers in steps.json (written by the instructor's record_steps.py from the toolkit's
own cost model; these checks never import it): the ring cases, six hand cases, and steps recorded from the
toolkit's strategies. A wrong answer is compared with what each classic mistake gives on the same case, and
the message names the one it matches.
"""
import json
import math
from pathlib import Path

from toolkit.grading import check, number, seconds, sibling
from toolkit.units import bytes_text

ANSWERS = {"toolkit.memory.formulas:alpha_beta_time": "the toolkit's own alpha-beta model",
           "toolkit.sim.timeline:schedule": "the toolkit's own overlap rule",
           "toolkit.sim.collective_time": "the toolkit's own collective times",
           "toolkit.sim.cost": "the toolkit's own cost model"}
INSTRUCTOR_ONLY = ["record_steps.py"]  # it computes the answers: `python -m toolkit release` leaves it out
TASKS = sibling(__file__)
decode, durations = TASKS.decode, TASKS.durations
DATA = json.loads(Path(__file__).with_name("steps.json").read_text())
RING_CASES = [  # (size_bytes, n, alpha, beta)
    (1024, 2, 1e-5, 1e-9), (10 * 2**20, 8, 5e-6, 1 / 25e9), (3 * 2**20, 3, 1e-3, 1e-8), (12345, 64, 2e-6, 1e-10),
    (2**30, 512, 9.6e-6, 1 / 200e9),
]
RING_MISTAKES = {
    "half": "counted one half: an all-reduce is a reduce-scatter AND an all-gather, 2(N-1) steps",
    "all_reduce": "counted an all-reduce's 2(N-1) steps: this collective is one half of it, N-1 steps",
    "latency_once": "paid the latency once: every one of the ring's steps is a message and pays alpha",
    "whole_buffer": "sent the whole buffer at every step: each step moves one chunk, size / N",
    "n_steps": "counted one step too many per half: a ring of N ranks needs N-1 steps to pass N chunks along",
}
STEP_MISTAKES = {
    "blocking": "charged every collective as if it blocked: nothing overlapped",
    "unwaited": ("ended the step when the compute stream finished: a collective still running (one nobody waits "
                 "for) holds the step open until it ends"),
    "never_stalled": "never stalled: a Wait must hold the compute stream until its collective ends",
    "never_stalled_nor_waited_out": ("never stalled, and ended the step with the compute stream: a Wait holds the "
                                     "compute stream until its collective ends, and the step ends after both streams"),
    "no_queue": "let collectives run at once: there is one communication stream, they take turns",
}
KEYS = ("step", "compute", "exposed_comm", "overlapped_comm")


def close(a, b) -> bool:
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-15)
    except (TypeError, ValueError):
        return False


def named(got, mistakes: dict, texts: dict) -> str:
    """" (you ...)" for the classic mistakes `got` equals, if any (on some cases two give the same number)."""
    matches = [text for key, text in texts.items() if key in mistakes and close(got, mistakes[key])]
    return f" (you {'; or you '.join(matches)})" if matches else ""


# --- the ring's collectives ------------------------------------------------------------------------------------
def judge_ring(ctx, got, ops):
    values = iter(got[0]["values"])
    for op in ops:
        for (size, n, alpha, beta), want in zip(RING_CASES, DATA["ring"][op]):
            value = next(values)
            if not close(value, want["expected"]):
                ctx.fail(f"{op} of {bytes_text(size)} over {n} ranks, alpha = {seconds(alpha)}, links of "
                         f"{bytes_text(1 / beta)}/s: got {seconds(value)}, expected {seconds(want['expected'])}"
                         + named(value, want["mistakes"], RING_MISTAKES))


@check("all_reduce_time: the ring all-reduce in the alpha-beta model, on five cases (2 to 512 ranks), 0 for one rank",
       points=2, world_sizes=(1,), task="ring_times",
       inputs={"cases": [("all_reduce", *case) for case in RING_CASES] + [("all_reduce", 2**20, 1, 1e-5, 1e-9)]})
def all_reduce(ctx, given, got):
    judge_ring(ctx, got, ["all_reduce"])
    if got[0]["values"][-1] != 0:
        ctx.fail("all_reduce over 1 rank: a group of one moves nothing, expected 0 s, got "
                 f"{seconds(got[0]['values'][-1])}")


@check("reduce_scatter_time and all_gather_time: the ring's two halves", points=2, world_sizes=(1,),
       task="ring_times", inputs={"cases": [(op, *case) for op in ("reduce_scatter", "all_gather")
                                            for case in RING_CASES]})
def reduce_scatter_and_all_gather(ctx, given, got):
    judge_ring(ctx, got, ["reduce_scatter", "all_gather"])


# --- the overlap rule -------------------------------------------------------------------------------------
def judge_steps(ctx, cases, breakdowns, what_of):
    for (name, want), got in zip(cases, breakdowns):
        what, expected = what_of(name), want["expected"]
        if not isinstance(got, dict) or not set(KEYS) <= set(got):
            ctx.fail(f"{what}: step_time must return a dict with step, compute, exposed_comm and overlapped_comm; "
                     f"got {number(got)}")
        for key in KEYS:
            if not close(got[key], expected[key]):
                ctx.fail(f"{what}: {key} = {seconds(got[key])}, expected {seconds(expected[key])} (step "
                         f"{seconds(expected['step'])} = compute {seconds(expected['compute'])} + exposed "
                         f"{seconds(expected['exposed_comm'])}; {seconds(expected['overlapped_comm'])} overlapped)"
                         + named(got["step"], want["mistakes"], STEP_MISTAKES))


def _c(label):
    return {"kind": "compute", "flops": 0.0, "label": label}


def _comm(i, async_op=True):
    return {"kind": "collective", "id": i, "op": "all_reduce", "size_bytes": 0, "bytes_sent": 0, "bytes_recv": 0,
            "group": [0, 1], "async_op": async_op}


def _wait(i):
    return {"kind": "wait", "id": i}


def _hand(program, compute: dict, comm: dict) -> dict:
    return {"program": program, "compute_s": [compute[i["label"]] if i["kind"] == "compute" else None for i in program],
            "comm_s": {str(k): v for k, v in comm.items()}}


HAND = {  # name -> the program, each compute's seconds (by position), each collective's (by id)
    "compute only": _hand([_c("a"), _c("b")], {"a": 1.0, "b": 2.0}, {}),
    "a synchronous all-reduce between two computes": _hand(
        [_c("a"), _comm(0, False), _wait(0), _c("b")], {"a": 1.0, "b": 1.0}, {0: 0.5}),
    "an asynchronous all-reduce, partly hidden by the compute issued after it": _hand(
        [_c("a"), _comm(0), _c("b"), _wait(0), _c("c")], {"a": 1.0, "b": 0.4, "c": 1.0}, {0: 1.0}),
    "two asynchronous collectives issued together, then 0.5 s of compute": _hand(
        [_comm(0), _comm(1), _c("a"), _wait(0), _wait(1)], {"a": 0.5}, {0: 1.0, 1: 1.0}),
    "a collective nobody waits for still ends the step": _hand([_c("a"), _comm(0)], {"a": 1.0}, {0: 2.0}),
    "a wait for a collective already done costs nothing": _hand([_comm(0), _c("a"), _wait(0)], {"a": 1.0}, {0: 0.2}),
}


@check("step_time on six hand cases: compute only, synchronous, hidden, queued, unwaited, already done",
       points=3, world_sizes=(1,), task="step_times", inputs={"cases": list(HAND.values())})
def overlap_by_hand(ctx, given, got):
    judge_steps(ctx, [(name, DATA["hand"][name]) for name in HAND], got[0]["breakdowns"], lambda name: name)


@check("step_time on steps recorded from the toolkit's strategies (ddp, zero1, zero3 with and without "
       "buckets, fsdp with and without prefetch)", points=3, world_sizes=(1,), task="step_times",
       inputs=lambda n, g: {"cases": [{k: s[k] for k in ("program", "compute_s", "comm_s")} for s in DATA["steps"]]})
def overlap_on_recorded_steps(ctx, given, got):
    judge_steps(ctx, [(s["name"], s) for s in DATA["steps"]], got[0]["breakdowns"],
                lambda name: f"the recorded {name} step on 8 ranks of one DGX A100 node")


@check("your whole model predicts the recorded steps: your collective times, then your overlap rule",
       points=1, world_sizes=(1,), inputs=lambda n, g: {"cases": [
           dict(program=s["program"], compute_s=s["compute_s"], alpha=s["alpha_beta"]["alpha"],
                beta=s["alpha_beta"]["beta"]) for s in DATA["steps"]]})
def whole_model(ctx, given, got):
    for step, mine in zip(DATA["steps"], got[0]["breakdowns"]):
        want, alpha, beta = step["alpha_beta"]["step"], step["alpha_beta"]["alpha"], step["alpha_beta"]["beta"]
        value = mine.get("step") if isinstance(mine, dict) else mine
        if not close(value, want):
            ctx.fail(f"the recorded {step['name']} step: your model predicts {seconds(value)}, the reference "
                     f"{seconds(want)} (NVLink: alpha {seconds(alpha)}, {bytes_text(1 / beta)}/s)")
