"""The graded checks of lab 10 (the cost model), judged in the grader's process. Pure functions: one rank runs
them all, and no message names a world size (the cases' N, 2 to 512 ranks, is in each message).

The model is the lab's answer, so nothing here computes it, and no file of the lab holds its values (steps.json
holds the recorded programs and their durations: inputs). What these checks judge is what any right answer must
satisfy, on cases drawn afresh for each grading: the ring's times are a latency term (a whole number of alphas)
plus a bandwidth term (bytes times beta), a group of one moves nothing, an all-reduce is its two halves; a step's
breakdown adds up, and at the extremes (compute alone, every collective waited for at once, everything issued
first) the overlap rule has only one possible answer. The exact values, and the classic mistake a wrong one
matches, are judged on the course platform (`hidden_checks.py`), on cases drawn the same way.
"""

import json
import math
import random
from pathlib import Path

from toolkit.grading import Fields, check, number, seconds, sibling
from toolkit.units import bytes_text

ANSWERS = {
    "toolkit.memory.formulas:alpha_beta_time": "the toolkit's own alpha-beta model",
    "toolkit.memory.formulas:_steps_and_bytes": "the ring's steps and bytes, the alpha-beta model's counts",
    "toolkit.memory.formulas:bytes_on_wire": "the ring's bytes per rank",
    "toolkit.memory.formulas:ring_reduce_scatter_bytes": "the ring's bytes per rank",
    "toolkit.memory.formulas:ring_all_gather_bytes": "the ring's bytes per rank",
    "toolkit.memory.formulas:ring_all_reduce_bytes": "the ring's bytes per rank",
    "toolkit.sim.timeline:schedule": "the toolkit's own overlap rule",
    "toolkit.sim.collective_time": "the toolkit's own collective times",
    "toolkit.sim.cost": "the toolkit's own cost model",
}
INSTRUCTOR_ONLY = ["record_steps.py"]  # it records the steps with the toolkit's own code: not released
TASKS = sibling(__file__)
decode, durations = TASKS.decode, TASKS.durations
DATA = json.loads(Path(__file__).with_name("steps.json").read_text())  # programs and durations: inputs only
OPS = ("all_reduce", "reduce_scatter", "all_gather")
KEYS = ("step", "compute", "exposed_comm", "overlapped_comm")
BREAKDOWN = Fields(
    {key: float for key in KEYS},
    extra=True,
    why="step_time returns a dict with step, compute, exposed_comm and overlapped_comm, in seconds",
)


def close(a, b) -> bool:
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-15)
    except (TypeError, ValueError):
        return False


def rng(g) -> random.Random:
    return random.Random(int(g.initial_seed()))


# --- the ring's collectives ------------------------------------------------------------------------------------
def ring_call(op, size, n, alpha, beta) -> str:
    return f"{op}_time({size}, {n}, {alpha!r}, {beta!r})"


def ring_cases(n_, g):
    """Drawn (size, N, alpha, beta), and the same with one term switched off or the size doubled; and N = 1."""
    r = rng(g)
    cases = {}
    for _ in range(4):
        size, n = r.randint(1, 2**31), r.choice([2, 3, 5, 8, 16, 100, 512])
        alpha, beta = r.uniform(1e-7, 1e-3), 1 / r.uniform(1e9, 1e12)
        variants = [
            (size, alpha, beta),
            (size, alpha, 0.0),
            (2 * size, alpha, 0.0),
            (size, 0.0, beta),
            (2 * size, 0.0, beta),
        ]
        calls = {ring_call(op, s, n, a, b): [op, s, n, a, b] for op in OPS for s, a, b in variants}
        name = f"{bytes_text(size)} over {n} ranks, alpha = {seconds(alpha)}, links of {bytes_text(1 / beta)}/s"
        cases[name] = {"size": size, "n": n, "alpha": alpha, "beta": beta, "calls": calls}
    calls = {ring_call(op, 2**20, 1, 1e-5, 1e-9): [op, 2**20, 1, 1e-5, 1e-9] for op in OPS}
    cases["1 MiB over 1 rank"] = {"size": 2**20, "n": 1, "alpha": 1e-5, "beta": 1e-9, "calls": calls}
    return cases


def values(case, r, n):
    return {key: float for key in case["calls"]}


@check(
    "the ring's collectives: nothing for one rank; alpha per message plus bytes times beta; each half moves less "
    "than the buffer; an all-reduce is a reduce-scatter and an all-gather",
    points=3,
    world_sizes=(1,),
    task="ring_times",
    cases=ring_cases,
    returns=values,
)
def ring_structure(ctx, given, got):
    size, n, alpha, beta = (given[0][k] for k in ("size", "n", "alpha", "beta"))
    time = {(op, s, a, b): got[0][ring_call(op, s, n, a, b)] for op, s, _, a, b in given[0]["calls"].values()}
    where = f"over {n} rank{'s' * (n > 1)}"
    if n == 1:
        for op in OPS:
            if time[op, size, alpha, beta] != 0:
                ctx.fail(
                    f"{op} {where}: a group of one moves nothing, expected 0 s, got "
                    f"{seconds(time[op, size, alpha, beta])}"
                )
        return
    for op in OPS:
        whole, latency, bandwidth = time[op, size, alpha, beta], time[op, size, alpha, 0.0], time[op, size, 0.0, beta]
        said = f"{op} of {bytes_text(size)} {where}"
        if not close(whole, latency + bandwidth):
            ctx.fail(
                f"{said}: {seconds(whole)} with alpha = {seconds(alpha)} and beta = {number(beta)} s/B, but "
                f"{seconds(latency)} with beta = 0 and {seconds(bandwidth)} with alpha = 0: every message costs "
                "alpha plus its bytes times beta, so the two terms add"
            )
        if not close(latency, time[op, 2 * size, alpha, 0.0]):
            ctx.fail(
                f"{said}, beta = 0: {seconds(latency)}, but {seconds(time[op, 2 * size, alpha, 0.0])} for twice "
                "the bytes: the latency term counts messages, not bytes"
            )
        messages = latency / alpha
        if abs(messages - round(messages)) > 1e-6 * max(1.0, messages) or round(messages) < 1:
            ctx.fail(
                f"{said}, beta = 0: {seconds(latency)} is {messages:.6g} alphas: every message pays alpha "
                "once, so the latency term is a whole number of alphas, one per step of the ring"
            )
        if not close(2 * bandwidth, time[op, 2 * size, 0.0, beta]):
            ctx.fail(
                f"{said}, alpha = 0: {seconds(bandwidth)}, and {seconds(time[op, 2 * size, 0.0, beta])} for "
                "twice the bytes: the bandwidth term is bytes times beta, twice the buffer twice the time"
            )
        share = bandwidth / (size * beta)  # the buffers' worth each rank sends
        if op != "all_reduce" and not share < 1:
            ctx.fail(
                f"{said}, alpha = 0: each rank sends {share:.6g} times the buffer; in a ring half every rank "
                "sends N-1 chunks of size / N, less than the buffer (did every step send the whole buffer, or "
                "one step too many?)"
            )
    halves = {op: time[op, size, alpha, beta] for op in OPS}
    if not close(halves["reduce_scatter"], halves["all_gather"]):
        ctx.fail(
            f"reduce-scatter {seconds(halves['reduce_scatter'])} and all-gather {seconds(halves['all_gather'])} "
            f"of {bytes_text(size)} {where}: the all-gather is the reduce-scatter's steps run the other way, "
            "the same messages"
        )
    if not close(halves["all_reduce"], halves["reduce_scatter"] + halves["all_gather"]):
        ctx.fail(
            f"all-reduce of {bytes_text(size)} {where}: {seconds(halves['all_reduce'])}, its halves "
            f"{seconds(halves['reduce_scatter'])} + {seconds(halves['all_gather'])}: an all-reduce is a "
            "reduce-scatter followed by an all-gather (did you count one half, or one step too many?)"
        )


# --- the overlap rule: the programs ------------------------------------------------------------------------------
def _c(label):
    return {"kind": "compute", "flops": 0.0, "label": label}


def _comm(i, async_op=True):
    return {
        "kind": "collective",
        "id": i,
        "op": "all_reduce",
        "size_bytes": 0,
        "bytes_sent": 0,
        "bytes_recv": 0,
        "group": [0, 1],
        "async_op": async_op,
    }


def _wait(i):
    return {"kind": "wait", "id": i}


HAND = {  # name -> a program (README, "2. The overlap rule"), each compute's seconds by label, each collective's by id
    "compute only": ([_c("a"), _c("b")], {"a": 1.0, "b": 2.0}, {}),
    "a synchronous all-reduce between two computes": (
        [_c("a"), _comm(0, False), _wait(0), _c("b")],
        {"a": 1.0, "b": 1.0},
        {0: 0.5},
    ),
    "an asynchronous all-reduce, partly hidden by the compute issued after it": (
        [_c("a"), _comm(0), _c("b"), _wait(0), _c("c")],
        {"a": 1.0, "b": 0.4, "c": 1.0},
        {0: 1.0},
    ),
    "two asynchronous collectives issued together, then compute": (
        [_comm(0), _comm(1), _c("a"), _wait(0), _wait(1)],
        {"a": 0.5},
        {0: 1.0, 1: 1.0},
    ),
    "a collective nobody waits for still ends the step": ([_c("a"), _comm(0)], {"a": 1.0}, {0: 2.0}),
    "a wait for a collective already done costs nothing": ([_comm(0), _c("a"), _wait(0)], {"a": 1.0}, {0: 0.2}),
}


def drawn_durations(program, compute: dict, comm: dict, r: random.Random, spread: float) -> dict:
    """A case of step_time: the program, and each instruction's duration drawn for this grading, its given one
    (compute by label or position, a collective by id) times a factor between 1 / spread and spread."""
    compute_s = [
        None
        if i["kind"] != "compute"
        else compute[i.get("label") if i.get("label") in compute else k] * spread ** r.uniform(-1, 1)
        for k, i in enumerate(program)
    ]
    comm_s = {
        str(i["id"]): comm[i["id"] if i["id"] in comm else str(i["id"])] * spread ** r.uniform(-1, 1)
        for i in program
        if i["kind"] == "collective"
    }
    return {"program": program, "compute_s": compute_s, "comm_s": comm_s}


def step_cases(n, g):
    """Every hand program (durations within 20% of the README's, so each keeps its story: a hidden collective stays
    hidden) and every recorded step (durations 0.1x to 10x the recorded ones), drawn for this grading."""
    r = rng(g)
    cases = {name: drawn_durations(program, compute, comm, r, 1.25) for name, (program, compute, comm) in HAND.items()}
    cases.update(
        {
            f"the recorded {s['name']} step": drawn_durations(
                s["program"], dict(enumerate(s["compute_s"])), s["comm_s"], r, 10.0
            )
            for s in DATA["steps"]
        }
    )
    return cases


def totals(case) -> tuple[float, float]:
    """(the compute times summed, the collectives' times summed): what the breakdown is made of."""
    compute = sum(s for i, s in zip(case["program"], case["compute_s"]) if i["kind"] == "compute")
    comm = sum(case["comm_s"][str(i["id"])] for i in case["program"] if i["kind"] == "collective")
    return compute, comm


def shown(breakdown) -> str:
    return ", ".join(f"{key} {seconds(breakdown[key])}" for key in KEYS)


@check(
    "step_time's breakdown adds up: compute the compute times' sum, step = compute + exposed, overlapped = "
    "communication - exposed, none negative, the step between the compute alone and everything in a row",
    points=2,
    world_sizes=(1,),
    task="step_times",
    cases=step_cases,
    returns={"breakdown": BREAKDOWN},
)
def breakdown_adds_up(ctx, given, got):
    compute, comm = totals(given[0])
    mine, tolerance = got[0]["breakdown"], 1e-9 * (compute + comm)
    said = f"{ctx.case} (compute {seconds(compute)} in all, communication {seconds(comm)}): you returned {shown(mine)}"
    if not close(mine["compute"], compute):
        ctx.fail(f"{said}; compute is the sum of the compute times, {seconds(compute)}")
    if not close(mine["step"], mine["compute"] + mine["exposed_comm"]):
        ctx.fail(f"{said}; exposed_comm is the step's time beyond its computation: step - compute")
    if not close(mine["overlapped_comm"], comm - mine["exposed_comm"]):
        ctx.fail(
            f"{said}; overlapped_comm is the communication that hid behind computation: the total communication "
            f"({seconds(comm)}) minus the exposed part"
        )
    if mine["exposed_comm"] < -tolerance or mine["overlapped_comm"] < -tolerance:
        ctx.fail(f"{said}; neither part of the communication can be negative")
    if not compute - tolerance <= mine["step"] <= compute + comm + tolerance:
        ctx.fail(
            f"{said}; a step lasts at least its computation and at most everything one after the other "
            f"({seconds(compute + comm)})"
        )


# --- the overlap rule: where it has one answer --------------------------------------------------------------------
def reordered(case, order) -> dict:
    """The case's program rearranged by `order` (a function of [(instruction, its compute seconds)])."""
    pairs = order(list(zip(case["program"], case["compute_s"])))
    return dict(case, program=[i for i, _ in pairs], compute_s=[s for _, s in pairs])


def _kind(pairs, kind):
    return [p for p in pairs if p[0]["kind"] == kind]


EXTREMES = {  # name -> (how the program is rearranged, its only possible step time from (compute, communication))
    "its compute alone": (lambda pairs: _kind(pairs, "compute"), lambda compute, comm: compute),
    "every collective waited for at once": (
        lambda pairs: [
            q
            for p in pairs
            if p[0]["kind"] != "wait"
            for q in ([p] + ([({"kind": "wait", "id": p[0]["id"]}, None)] if p[0]["kind"] == "collective" else []))
        ],
        lambda compute, comm: compute + comm,
    ),
    "every collective issued first, then the compute, then the waits": (
        lambda pairs: _kind(pairs, "collective") + _kind(pairs, "compute") + _kind(pairs, "wait"),
        max,
    ),
    "the compute, then collectives nobody waits for": (
        lambda pairs: _kind(pairs, "compute") + _kind(pairs, "collective"),
        lambda compute, comm: compute + comm,
    ),
    "its collectives alone, issued together, then waited for": (
        lambda pairs: _kind(pairs, "collective") + _kind(pairs, "wait"),
        lambda compute, comm: comm,
    ),
}
WHY = {
    "its compute alone": "with no communication the step is its computation",
    "every collective waited for at once": (
        "a Wait right after each collective holds the compute stream until it "
        "ends: nothing can overlap, and the step is everything one after the "
        "other (did a Wait not hold the compute stream?)"
    ),
    "every collective issued first, then the compute, then the waits": (
        "the collectives take turns on the one communication stream while the compute runs: the step is the longer "
        "of the two streams (did collectives run at once, or block the compute?)"
    ),
    "the compute, then collectives nobody waits for": (
        "a collective nobody waits for still ends the step: the step ends when both streams are done"
    ),
    "its collectives alone, issued together, then waited for": (
        "there is one communication stream: collectives take turns, so together they last their sum (did "
        "collectives run at once?)"
    ),
}


def extreme_cases(n, g):
    found = {}
    for name, case in step_cases(n, g).items():
        for extreme, (order, _) in EXTREMES.items():
            found[f"{name}, {extreme}"] = dict(reordered(case, order), extreme=extreme)
    return found


@check(
    "step_time where the rule has one answer: compute alone, collectives alone, every collective waited for at "
    "once, everything issued first, collectives nobody waits for",
    points=3,
    world_sizes=(1,),
    task="step_times",
    cases=extreme_cases,
    returns={"breakdown": BREAKDOWN},
)
def extremes(ctx, given, got):
    compute, comm = totals(given[0])
    extreme = given[0]["extreme"]
    expected = EXTREMES[extreme][1](compute, comm)
    if not close(got[0]["breakdown"]["step"], expected):
        ctx.fail(
            f"{ctx.case}: step = {seconds(got[0]['breakdown']['step'])}, expected {seconds(expected)} (compute "
            f"{seconds(compute)}, communication {seconds(comm)}): {WHY[extreme]}"
        )
