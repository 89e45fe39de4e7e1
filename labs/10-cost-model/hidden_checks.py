"""Lab 10's hidden checks: graded on the course platform, not released to students (`python -m toolkit release`
leaves this file out). Cases drawn afresh for every grading, judged against the toolkit's own cost model (which
the released checks may not import): an answer that only memorised steps.json fails here."""
import random

from checks import DATA, RING_MISTAKES, close, named  # the public checks' helpers
from toolkit.grading import check, seconds, sibling
from toolkit.memory.formulas import alpha_beta_time
from toolkit.sim.timeline import schedule

TASKS = sibling(__file__)
OPS = ("all_reduce", "reduce_scatter", "all_gather")


def _ring_cases(n, g):
    rng = random.Random(int(g.initial_seed()))
    return {"cases": [(op, rng.randint(1, 2**31), rng.choice([2, 3, 5, 8, 16, 100, 1024]), rng.uniform(1e-7, 1e-3),
                       1 / rng.uniform(1e9, 1e12)) for op in OPS for _ in range(4)]}


@check("the ring's three collectives on cases drawn for this grading", points=1, world_sizes=(1,), task="ring_times",
       inputs=_ring_cases, feedback="a collective's time is wrong on a case the released checks do not try")
def ring_times_drawn(ctx, given, got):
    for (op, size, n, alpha, beta), value in zip(given[0]["cases"], got[0]["values"]):
        want = alpha_beta_time(op, size, n, alpha, beta)
        if not close(value, want):
            ctx.fail(f"{op} of {size} bytes over {n} ranks: got {seconds(value)}, expected {seconds(want)}"
                     + named(value, {}, RING_MISTAKES))


class _Cost:
    def __init__(self, seconds):
        self.seconds, self.resources = seconds, ("link",)


def _step_cases(n, g):
    """The recorded programs with every duration drawn afresh (between 0.1x and 10x the recorded one)."""
    rng = random.Random(int(g.initial_seed()))
    cases = []
    for step in DATA["steps"]:
        compute = [None if s is None else s * 10 ** rng.uniform(-1, 1) for s in step["compute_s"]]
        comm = {k: v * 10 ** rng.uniform(-1, 1) for k, v in step["comm_s"].items()}
        cases.append({"program": step["program"], "compute_s": compute, "comm_s": comm})
    return {"cases": cases}


@check("step_time on the recorded programs with durations drawn for this grading", points=2, world_sizes=(1,),
       task="step_times", inputs=_step_cases,
       feedback="the overlap rule is wrong on durations the released checks do not try")
def step_times_drawn(ctx, given, got):
    for step, case, mine in zip(DATA["steps"], given[0]["cases"], got[0]["breakdowns"]):
        program = TASKS.decode(case["program"])
        compute, comm = TASKS.durations(program, case["compute_s"], case["comm_s"])
        want = schedule(program, compute, lambda c: _Cost(comm(c))).breakdown()
        for key in ("step", "compute", "exposed_comm", "overlapped_comm"):
            if not isinstance(mine, dict) or not close(mine.get(key), want[key]):
                ctx.fail(f"the {step['name']} program with drawn durations: {key} = "
                         f"{seconds(mine.get(key)) if isinstance(mine, dict) else mine!r:.60}, expected "
                         f"{seconds(want[key])}")
