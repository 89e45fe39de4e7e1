"""Lab 10's hidden checks: graded on the course platform, not released to students (`python -m toolkit release`
leaves this file out). The exact values, against the toolkit's own cost model (which the released checks may not
import: it is the answer), on cases drawn afresh for every grading; a wrong value is compared with what each classic
mistake gives on the same case, and the instructor's report names the one it matches."""

from checks import BREAKDOWN, DATA, KEYS, OPS, close, ring_call, rng, shown, step_cases, values

from toolkit.grading import check, seconds, sibling
from toolkit.memory.formulas import alpha_beta_time
from toolkit.sim import Collective, Compute, Wait
from toolkit.sim.timeline import schedule
from toolkit.units import bytes_text

TASKS = sibling(__file__)
RING_MISTAKES = {
    "half": "counted one half: an all-reduce is a reduce-scatter AND an all-gather, 2(N-1) steps",
    "all_reduce": "counted an all-reduce's 2(N-1) steps: this collective is one half of it, N-1 steps",
    "latency_once": "paid the latency once: every one of the ring's steps is a message and pays alpha",
    "whole_buffer": "sent the whole buffer at every step: each step moves one chunk, size / N",
    "n_steps": "counted one step too many per half: a ring of N ranks needs N-1 steps to pass N chunks along",
}
STEP_MISTAKES = {
    "blocking": "charged every collective as if it blocked: nothing overlapped",
    "unwaited": (
        "ended the step when the compute stream finished: a collective still running (one nobody waits "
        "for) holds the step open until it ends"
    ),
    "never_stalled": "never stalled: a Wait must hold the compute stream until its collective ends",
    "never_stalled_nor_waited_out": (
        "never stalled, and ended the step with the compute stream: a Wait holds the "
        "compute stream until its collective ends, and the step ends after both streams"
    ),
    "no_queue": "let collectives run at once: there is one communication stream, they take turns",
}


# --- the answers, and what each classic mistake gives instead ------------------------------------------------------
class _Cost:
    def __init__(self, seconds, resources=("link",)):
        self.seconds, self.resources = seconds, resources  # one communication stream, as in the lab


def replay(program, compute, comm, *, waits=True, tail=True, queue=True, blocking=False) -> dict:
    """The reference breakdown (the toolkit's schedule), or a classic mistake's step time."""
    if waits and tail and queue and not blocking:
        return schedule(program, compute, lambda c: _Cost(comm(c))).breakdown()
    if blocking:
        return {
            "step": sum(compute(i) for i in program if isinstance(i, Compute))
            + sum(comm(i) for i in program if isinstance(i, Collective))
        }
    kept = [i for i in program if waits or not isinstance(i, Wait)]
    timeline = schedule(kept, compute, lambda c: _Cost(comm(c), ("link",) if queue else ()))
    if tail:
        return {"step": timeline.step_time}
    return {"step": max([s.end for s in timeline.spans if s.kind == "compute"], default=0.0)}


MISTAKE_RULES = {
    "blocking": dict(blocking=True),
    "never_stalled": dict(waits=False),
    "unwaited": dict(tail=False),
    "never_stalled_nor_waited_out": dict(waits=False, tail=False),
    "no_queue": dict(queue=False),
}


def step_values(program, compute, comm) -> dict:
    right = replay(program, compute, comm)
    wrong = {key: replay(program, compute, comm, **rule)["step"] for key, rule in MISTAKE_RULES.items()}
    both = "never_stalled_nor_waited_out"  # named only where neither mistake alone explains the number
    if any(abs(wrong[both] - wrong[one]) <= 1e-12 for one in ("never_stalled", "unwaited")):
        del wrong[both]
    return {"expected": right, "mistakes": {k: v for k, v in wrong.items() if abs(v - right["step"]) > 1e-12}}


def ring_values(op, size, n, alpha, beta) -> dict:
    chunk = size / n
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1
    wrong = {
        "half": (n - 1) * (alpha + chunk * beta),
        "latency_once": alpha + steps * chunk * beta,
        "whole_buffer": steps * (alpha + size * beta),
        "n_steps": (steps + (2 if op == "all_reduce" else 1)) * (alpha + chunk * beta),
        "all_reduce": 2 * (n - 1) * (alpha + chunk * beta),
    }
    right = alpha_beta_time(op, size, n, alpha, beta)
    return {"expected": right, "mistakes": {k: v for k, v in wrong.items() if abs(v - right) > 1e-15 * max(right, 1)}}


def named(got, mistakes: dict, texts: dict) -> str:
    """ " (you ...)" for the classic mistakes `got` equals, if any (on some cases two give the same number)."""
    matches = [text for key, text in texts.items() if key in mistakes and close(got, mistakes[key])]
    return f" (you {'; or you '.join(matches)})" if matches else ""


def drawn_rings(n, g):
    r = rng(g)
    cases = {}
    for op in OPS:
        for _ in range(4):
            size, ranks = r.randint(1, 2**31), r.choice([2, 3, 5, 8, 16, 100, 1024])
            alpha, beta = r.uniform(1e-7, 1e-3), 1 / r.uniform(1e9, 1e12)
            cases[f"{op} of {bytes_text(size)} over {ranks} ranks"] = {
                "case": [op, size, ranks, alpha, beta],
                "calls": {ring_call(op, size, ranks, alpha, beta): [op, size, ranks, alpha, beta]},
            }
    return cases


@check(
    "the ring's three collectives on cases drawn for this grading",
    points=2,
    world_sizes=(1,),
    task="ring_times",
    cases=drawn_rings,
    returns=values,
    feedback="a collective's time is wrong on a case drawn for this grading: count the ring's steps and the bytes "
    "of each message again (README, section 1)",
)
def ring_times_drawn(ctx, given, got):
    op, size, n, alpha, beta = given[0]["case"]
    value, want = got[0][ring_call(op, size, n, alpha, beta)], ring_values(op, size, n, alpha, beta)
    if not close(value, want["expected"]):
        ctx.fail(
            f"{op} of {size} bytes over {n} ranks: got {seconds(value)}, expected {seconds(want['expected'])}"
            + named(value, want["mistakes"], RING_MISTAKES)
        )


def judge_step(ctx, case, mine, expected: dict, mistakes: dict) -> None:
    for key in KEYS:
        if not close(mine[key], expected[key]):
            ctx.fail(
                f"{ctx.case}: {key} = {seconds(mine[key])}, expected {seconds(expected[key])} (you returned "
                f"{shown(mine)}; expected {shown(expected)})" + named(mine["step"], mistakes, STEP_MISTAKES)
            )


def reference(case) -> dict:
    program = TASKS.decode(case["program"])
    return step_values(program, *TASKS.durations(program, case["compute_s"], case["comm_s"]))


def hand_cases(n, g):
    return {name: case for name, case in step_cases(n, g).items() if not name.startswith("the recorded")}


def recorded_cases(n, g):
    return {name: case for name, case in step_cases(n, g).items() if name.startswith("the recorded")}


@check(
    "step_time on the six hand programs, with durations drawn for this grading",
    points=1,
    world_sizes=(1,),
    task="step_times",
    cases=hand_cases,
    returns={"breakdown": BREAKDOWN},
    feedback="the overlap rule is wrong on one of the six hand programs: replay it by hand (README, section 2)",
)
def hand_programs(ctx, given, got):
    want = reference(given[0])
    judge_step(ctx, given[0], got[0]["breakdown"], want["expected"], want["mistakes"])


@check(
    "step_time on the recorded programs, with durations drawn for this grading",
    points=2,
    world_sizes=(1,),
    task="step_times",
    cases=recorded_cases,
    returns={"breakdown": BREAKDOWN},
    feedback="the overlap rule is wrong on a recorded step with durations drawn for this grading",
)
def recorded_programs(ctx, given, got):
    want = reference(given[0])
    judge_step(ctx, given[0], got[0]["breakdown"], want["expected"], want["mistakes"])


def whole_model_cases(n, g):
    """The recorded programs, their compute times, and an alpha and a beta drawn for this grading."""
    r = rng(g)
    return {
        f"the recorded {s['name']} step": {
            "program": s["program"],
            "compute_s": s["compute_s"],
            "alpha": r.uniform(1e-6, 1e-4),
            "beta": 1 / r.uniform(1e10, 1e12),
        }
        for s in DATA["steps"]
    }


@check(
    "your whole model (your collective times, then your overlap rule) on the recorded steps, alpha and beta drawn "
    "for this grading",
    points=1,
    world_sizes=(1,),
    task="whole_model",
    cases=whole_model_cases,
    returns={"breakdown": BREAKDOWN},
    feedback="your whole model predicts a recorded step wrongly: check the collective times and the overlap rule",
)
def whole_model(ctx, given, got):
    case = given[0]
    program = TASKS.decode(case["program"])
    compute, _ = TASKS.durations(program, case["compute_s"], {})
    want = replay(
        program, compute, lambda c: alpha_beta_time(c.op, c.size_bytes, len(c.group), case["alpha"], case["beta"])
    )
    if not close(got[0]["breakdown"]["step"], want["step"]):
        ctx.fail(
            f"{ctx.case}: your model predicts {seconds(got[0]['breakdown']['step'])}, the reference "
            f"{seconds(want['step'])} (alpha {seconds(case['alpha'])}, {bytes_text(1 / case['beta'])}/s)"
        )
