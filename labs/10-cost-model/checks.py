"""The graded checks of lab 10 (the cost model). Pure functions, so one rank runs them all.

The collectives' times are checked against the lessons' formula (`toolkit.memory.alpha_beta_time`),
the overlap rule against the toolkit's own (`toolkit.sim.timeline.schedule`) on hand cases and on
steps recorded from the toolkit's strategies (`steps.json`, written by `record_steps.py`). A wrong
answer is compared with the classic mistakes, and the message names the one it matches.
"""
import json
import math
from pathlib import Path

from toolkit.grading import check
from toolkit.memory.formulas import alpha_beta_time
from toolkit.sim import Collective, Compute, Wait, cluster_of, compute_time
from toolkit.sim.collective_time import collective_time
from toolkit.sim.timeline import schedule

HERE = Path(__file__).resolve().parent
RING_CASES = [  # (size_bytes, n, alpha, beta)
    (1024, 2, 1e-5, 1e-9), (10 * 2**20, 8, 5e-6, 1 / 25e9), (3 * 2**20, 3, 1e-3, 1e-8), (12345, 64, 2e-6, 1e-10),
    (2**30, 512, 9.6e-6, 1 / 200e9),
]


def close(a, b) -> bool:
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-15)
    except (TypeError, ValueError):
        return False


def ring_mistake(got, size, n, alpha, beta) -> str:
    """Name the mistake `got` matches, if any."""
    chunk = size / n
    guesses = {
        "counted one half: an all-reduce is a reduce-scatter AND an all-gather, 2(N-1) steps":
            (n - 1) * (alpha + chunk * beta),
        "paid the latency once: every one of the ring's steps is a message and pays alpha":
            alpha + 2 * (n - 1) * chunk * beta,
        "sent the whole buffer at every step: each step moves one chunk, size / N":
            2 * (n - 1) * (alpha + size * beta),
        "counted N steps instead of N-1": 2 * n * (alpha + chunk * beta),
    }
    for text, value in guesses.items():
        if close(got, value):
            return f" (you {text})"
    return ""


def expect_ring(ctx, student_fn, op, size, n, alpha, beta):
    got = student_fn(size, n, alpha, beta)
    want = alpha_beta_time(op, size, n, alpha, beta)
    if not close(got, want):
        hint = ring_mistake(got, size, n, alpha, beta) if op == "all_reduce" else ""
        ctx.fail(f"{op} of {size} bytes over {n} ranks, alpha={alpha:g} s, beta={beta:g} s/B: got {got!r}, "
                 f"expected {want:.6g} s{hint}")


@check("all_reduce_time: the ring's 2(N-1) steps of one chunk, on five cases", points=2, world_sizes=(1,))
def all_reduce(student, ctx):
    for case in RING_CASES:
        expect_ring(ctx, student.all_reduce_time, "all_reduce", *case)
    if student.all_reduce_time(2**20, 1, 1e-5, 1e-9) != 0:
        ctx.fail("all_reduce over 1 rank: a group of one moves nothing, expected 0 s")


@check("reduce_scatter_time and all_gather_time: N-1 steps of one chunk", points=2, world_sizes=(1,))
def reduce_scatter_and_all_gather(student, ctx):
    for case in RING_CASES:
        expect_ring(ctx, student.reduce_scatter_time, "reduce_scatter", *case)
        expect_ring(ctx, student.all_gather_time, "all_gather", *case)


# --- the overlap rule -------------------------------------------------------------------------------------
class _Cost:
    def __init__(self, seconds):
        self.seconds, self.resources = seconds, ("link",)  # one communication stream, as in the lab


def reference(program, compute_seconds, comm_seconds) -> dict:
    return schedule(program, compute_seconds, lambda c: _Cost(comm_seconds(c))).breakdown()


def overlap_mistake(got, program, compute_seconds, comm_seconds) -> str:
    compute = sum(compute_seconds(i) for i in program if isinstance(i, Compute))
    comm = sum(comm_seconds(i) for i in program if isinstance(i, Collective))
    no_queue = schedule(program, compute_seconds,
                        lambda c: type("C", (), {"seconds": comm_seconds(c), "resources": ()})()).step_time
    guesses = {
        "charged every collective as if it blocked: nothing overlapped": compute + comm,
        "never stalled: a Wait must hold the compute stream until its collective ends": compute,
        "let collectives run at once: there is one communication stream, they take turns": no_queue,
    }
    for text, value in guesses.items():
        if close(got, value) and not close(value, reference(program, compute_seconds, comm_seconds)["step"]):
            return f" (you {text})"
    return ""


def expect_step(ctx, student, program, compute_seconds, comm_seconds, what):
    want = reference(program, compute_seconds, comm_seconds)
    got = student.step_time(program, compute_seconds, comm_seconds)
    if not isinstance(got, dict) or not {"step", "compute", "exposed_comm", "overlapped_comm"} <= set(got):
        ctx.fail(f"{what}: step_time must return a dict with step, compute, exposed_comm and overlapped_comm; "
                 f"got {got!r}")
    for key in ("step", "compute", "exposed_comm", "overlapped_comm"):
        if not close(got[key], want[key]):
            hint = overlap_mistake(got["step"], program, compute_seconds, comm_seconds)
            ctx.fail(f"{what}: {key} = {got[key]!r}, expected {want[key]:.6g} s (reference step "
                     f"{want['step']:.6g} s = compute {want['compute']:.6g} + exposed {want['exposed_comm']:.6g}; "
                     f"{want['overlapped_comm']:.6g} overlapped){hint}")


def _c(label):
    return Compute(0.0, label=label)


def _comm(i, async_op=True):
    return Collective(i, "all_reduce", 0, 0, 0, (0, 1), async_op)


HAND = {  # name -> (program, compute seconds by label, comm seconds by id)
    "compute only": ([_c("a"), _c("b")], {"a": 1.0, "b": 2.0}, {}),
    "a synchronous all-reduce between two computes": (
        [_c("a"), _comm(0, False), Wait(0), _c("b")], {"a": 1.0, "b": 1.0}, {0: 0.5}),
    "an asynchronous all-reduce, partly hidden by the compute issued after it": (
        [_c("a"), _comm(0), _c("b"), Wait(0), _c("c")], {"a": 1.0, "b": 0.4, "c": 1.0}, {0: 1.0}),
    "two asynchronous collectives issued together, then 0.5 s of compute": (
        [_comm(0), _comm(1), _c("a"), Wait(0), Wait(1)], {"a": 0.5}, {0: 1.0, 1: 1.0}),
    "a collective nobody waits for still ends the step": ([_c("a"), _comm(0)], {"a": 1.0}, {0: 2.0}),
    "a wait for a collective already done costs nothing": ([_comm(0), _c("a"), Wait(0)], {"a": 1.0}, {0: 0.2}),
}


@check("step_time on six hand cases: compute, synchronous, hidden, queued, unwaited, already done",
       points=3, world_sizes=(1,))
def overlap_by_hand(student, ctx):
    for name, (program, compute, comm) in HAND.items():
        expect_step(ctx, student, program, lambda c: compute[c.label], lambda c: comm[c.id], name)


# --- recorded steps -------------------------------------------------------------------------------------------
def recorded_steps():
    """The steps `record_steps.py` recorded: {name: (world_size, program)}."""
    data = json.loads((HERE / "steps.json").read_text())
    kinds = {"compute": Compute, "collective": Collective, "wait": Wait}
    steps = {}
    for step in data["steps"]:
        program = []
        for item in step["program"]:
            fields = dict(item)
            kind = kinds[fields.pop("kind")]
            if kind is Collective:
                fields["group"] = tuple(fields["group"])
            program.append(kind(**fields))
        steps[step["name"]] = (step["world_size"], program)
    return steps


NODE = cluster_of("dgx-a100")


def reference_seconds(world):
    compute = lambda c: compute_time(c, NODE.gpu, "bf16")  # noqa: E731
    comm = lambda c: collective_time(NODE, c.op, c.size_bytes, c.group, 0, c.args).seconds  # noqa: E731
    return compute, comm


@check("step_time on steps recorded from the toolkit's strategies (ddp, zero1, zero3 with and without "
       "buckets, fsdp with and without prefetch)", points=3, world_sizes=(1,))
def overlap_on_recorded_steps(student, ctx):
    for name, (world, program) in recorded_steps().items():
        compute, comm = reference_seconds(world)
        expect_step(ctx, student, program, compute, comm, f"the recorded {name} step on {world} ranks of one "
                                                          f"DGX A100 node")


@check("your whole model predicts the recorded steps: your collective times, then your overlap rule",
       points=1, world_sizes=(1,))
def whole_model(student, ctx):
    times = {"all_reduce": student.all_reduce_time, "reduce_scatter": student.reduce_scatter_time,
             "all_gather": student.all_gather_time}
    alpha, beta = NODE.intra.latency, 1 / NODE.intra.bandwidth
    for name, (world, program) in recorded_steps().items():
        compute, _ = reference_seconds(world)
        mine = student.step_time(program, compute, lambda c: times[c.op](c.size_bytes, len(c.group), alpha, beta))
        want = reference(program, compute, lambda c: alpha_beta_time(c.op, c.size_bytes, len(c.group), alpha, beta))
        if not close(mine["step"], want["step"]):
            ctx.fail(f"the recorded {name} step: your model predicts {mine['step']:.6g} s, the reference "
                     f"{want['step']:.6g} s (NVLink: alpha {alpha:g} s, {1 / beta / 1e9:g} GB/s)")
