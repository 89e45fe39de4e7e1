"""The graded checks of lab 12 (1F1B's action list), judged in the grader's process.

The first five read your lists as data (tasks.py returns what `one_f_one_b` gave at pp = 2, 3, 4, with m = pp
and an m drawn for this grading): well formed, 1F1B's warm-up, its memory bound, no deadlock and its bubble in a
dry run. The dry run is the toolkit's own (`lowering.replay`: every rank's list stepped on a clock, a forward
costing 1 and a backward 2, a receive waiting for its send), run here on your lists, never on your code. The
last check has the toolkit's driver run your lists on 2, 3 and 4 real ranks, training a 12-block GPT from a
seed drawn for this grading; here the same GPT trains in one process on the same batches, the reference the
pipeline must match.
"""

import functools

import torch

from toolkit.grading import Either, Items, Keys, List, Tensor, check, like, sibling
from toolkit.models import SyntheticCorpus, tiny_gpt
from toolkit.parallel.pipeline import bubble, lowering, schedules
from toolkit.parallel.pipeline.schedules import Action

ANSWERS = {
    "toolkit.parallel.pipeline.schedules:one_f_one_b": "the toolkit's own 1F1B schedule",
    "toolkit.parallel.pipeline.schedules:interleaved": "the toolkit's interleaved 1F1B (1F1B with another "
    "warm-up; one virtual stage is 1F1B)",
    "toolkit.parallel.pipeline.schedules:zb_h1": "the toolkit's zero-bubble schedule, whose forwards and "
    "backwards run in 1F1B's order",
}
PIPELINES = (2, 3, 4)
STEPS = 2
OPTIMIZER = dict(lr=0.1, momentum=0.9)
# fp32, as tests/test_pipeline.py derives them: a pipeline changes only the order of sums. At most 9 micro-batches
# of one 32-token row: the loss (about 4.2), a mean of 288 per-token losses, moves by at most 288 · 2^-24 · 4.2 =
# 7.2e-5; a gradient element by 288 · 2^-24 = 1.7e-5, and two SGD steps (lr 0.1, momentum 0.9) a parameter by
# 0.1 · 2.9 · 1.7e-5 = 5e-6. A micro-batch left out moves a parameter by lr·|g|, 1e-3 and more.
LOSS_ATOL, PARAM_ATOL = 1e-4, 1e-5
# The dry run adds costs of 1 and 2: its times are exact in floats, and a bubble's fraction is off by a rounding
# (1e-16) at most, while one time unit more in a step of 3(m + pp - 1) units moves it by more than 1e-2.
BUBBLE_TOLERANCE = 1e-9
TASKS = sibling(__file__)
MODEL = TASKS.MODEL  # the GPT the ranks build (tasks.py)


def layouts(n, g):
    """(pp, m) for pp = 2, 3, 4: m = pp (1F1B's warm-up fills the pipeline exactly) and an m drawn in pp+1 .. 3pp."""
    drawn = [int(torch.randint(pp + 1, 3 * pp + 1, (), generator=g)) for pp in PIPELINES]
    return {
        f"pp={pp}, microbatches={m}": {"pp": pp, "microbatches": m}
        for pp, more in zip(PIPELINES, drawn)
        for m in (pp, more)
    }


ACTION = Items(
    str,
    int,
    int,
    why="each action is Action(kind, micro, stage), e.g. Action('F', 0, rank) (a (kind, "
    "micro, stage) tuple is fine too)",
)


def lists_returned(case, r, n):
    """What the task returns for one layout: every rank's list, under the call that made it."""
    return Keys(
        [TASKS.call(case["pp"], case["microbatches"], rank) for rank in range(case["pp"])],
        List(ACTION, why="one_f_one_b returns a list of Action(kind, micro, stage)"),
    )


def well_formed(ctx, given, got) -> tuple:
    """(pp, m, every rank's Actions) of this layout, checked: every F and B once, each B after its F."""
    pp, m = given[0]["pp"], given[0]["microbatches"]
    actions = [[Action(*a) for a in got[0][TASKS.call(pp, m, r)]] for r in range(pp)]
    try:
        schedules.check(actions, pp, m)
    except ValueError as exc:
        ctx.fail(f"pp={pp}, microbatches={m}: {exc}")
    return pp, m, actions


def shown(actions) -> str:
    """A list of actions as the diagram prints them (1F3: stage 1, forward, micro-batch 3)."""
    return " ".join(repr(Action(*a)) for a in actions)


def dry_run(ctx, actions, pp: int, m: int, why: str = "") -> list:
    """The replay of every rank's list (forward 1, backward 2), or a failure naming where each rank waits."""
    try:
        return lowering.replay(lowering.lower(actions, pp), lowering.unit_cost(False))
    except lowering.PipelineDeadlock as exc:
        ctx.fail(f"pp={pp}, microbatches={m}: {why}{exc}")


@check(
    "every micro-batch's forward and backward on every rank, once each, the backward after the forward",
    points=1,
    world_sizes=(2,),
    pure=True,
    task="lists",
    cases=layouts,
    returns=lists_returned,
)
def complete(ctx, given, got):
    well_formed(ctx, given, got)


@check(
    "memory: rank r never holds more than pp - r micro-batches' activations",
    points=1,
    world_sizes=(2,),
    pure=True,
    task="lists",
    cases=layouts,
    returns=lists_returned,
)
def memory(ctx, given, got):
    pp, m, actions = well_formed(ctx, given, got)
    for rank, mine in enumerate(actions):
        held, bound = bubble.in_flight(mine), bubble.formula_in_flight("1f1b", pp, m, rank)
        if held > bound:
            ctx.fail(
                f"pp={pp}, microbatches={m}: rank {rank} holds {held} micro-batches' activations at once "
                f"(forwards run whose backward has not); 1F1B holds at most pp - rank = {bound}: each "
                f"backward frees one before the next forward. All forwards first is GPipe: m on every rank"
            )


@check(
    "no deadlock: a dry run of every rank's list completes",
    points=1,
    world_sizes=(2,),
    pure=True,
    task="lists",
    cases=layouts,
    returns=lists_returned,
)
def no_deadlock(ctx, given, got):
    pp, m, actions = well_formed(ctx, given, got)
    dry_run(ctx, actions, pp, m)


@check(
    "the bubble: every rank idles (pp - 1) / (m + pp - 1) of the step in a dry run",
    points=1,
    world_sizes=(2,),
    pure=True,
    task="lists",
    cases=layouts,
    returns=lists_returned,
)
def bubble_size(ctx, given, got):
    pp, m, actions = well_formed(ctx, given, got)
    timeline = dry_run(ctx, actions, pp, m, "the schedule deadlocks, so it has no bubble to measure: ")
    busy, span = lowering.busy_and_span(timeline)
    formula = bubble.formula_bubble("1f1b", pp, m)
    for rank, work in enumerate(busy):
        idle = 1 - work / span
        if abs(idle - formula) > BUBBLE_TOLERANCE:
            ctx.fail(
                f"pp={pp}, microbatches={m}: rank {rank} idles {idle:.1%} of the step in a dry run "
                f"(forward 1, backward 2); 1F1B's bubble is (pp-1)/(m+pp-1) = {formula:.1%}. A rank that "
                f"waits for a gradient it could have had earlier, or runs a forward late, stretches the step"
            )


# --- on real ranks ---------------------------------------------------------------------------------------
def training(n, g):
    """The GPT's seed and an m drawn in pp .. 2pp + 1; m rows per step (one per micro-batch), the same on every rank."""
    m = int(torch.randint(n, 2 * n + 2, (), generator=g))
    corpus = SyntheticCorpus()
    return {
        "seed": int(torch.randint(0, 2**31, (), generator=g)),
        "microbatches": m,
        "optimizer": OPTIMIZER,
        "batches": [corpus.batch(step, m) for step in range(STEPS)],
    }


def one_process(seed, batches):
    """The reference: the same GPT trained alone on the whole batches; (its parameters, its losses)."""
    torch.manual_seed(seed)
    model = tiny_gpt(**MODEL)
    opt = torch.optim.SGD(model.parameters(), **OPTIMIZER)
    losses = []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return dict(model.named_parameters()), losses


@functools.cache
def parameters_of_the_gpt() -> dict:
    with torch.device("meta"):
        return {name: like(p) for name, p in tiny_gpt(**MODEL).named_parameters()}


def trained(case, r, n):
    """What a rank returns: the driver's refusal, or its losses, what it ran, its list (and rank 0 the weights)."""
    actions = List(ACTION, why="one_f_one_b returns a list of Action(kind, micro, stage)")
    return Either(
        {"refused": str},
        {
            "losses": List(Tensor((), torch.float32), STEPS),
            "ran": List(ACTION),
            "listed": actions,
            "state": parameters_of_the_gpt() if r == 0 else None,
        },
    )


@check(
    "on real ranks, pp = 2, 3, 4: the toolkit's driver runs your lists and a 12-block GPT trains as one process does",
    points=2,
    world_sizes=PIPELINES,
    task="real_ranks",
    inputs=training,
    returns=trained,
)
def real_ranks(ctx, given, got):
    pp, m = ctx.world_size, given[0]["microbatches"]
    for r in range(pp):
        if "refused" in got[r]:
            ctx.fail(f"rank {r}: the toolkit's driver refused to run your lists at pp={pp}: {got[r]['refused']}")
    for r in range(pp):
        if got[r]["ran"] != got[r]["listed"]:
            ctx.fail(
                f"rank {r} ran {shown(got[r]['ran'])}, not its list {shown(got[r]['listed'])}: one_f_one_b "
                f"must return the same list every time it is called with the same arguments"
            )
    parameters, losses = one_process(given[0]["seed"], given[0]["batches"])
    for r in range(pp):
        for step, expected in enumerate(losses):
            ctx.expect(
                got[r]["losses"][step],
                expected,
                f"pp={pp}, {m} micro-batches: the loss of step {step}",
                rank=r,
                exact=False,
                rtol=0,
                atol=LOSS_ATOL,
            )
    state = got[0]["state"]
    for name, expected in parameters.items():
        ctx.expect(
            state[name],
            expected.detach(),
            f"pp={pp}, {m} micro-batches: {name} after {STEPS} steps",
            exact=False,
            rtol=0,
            atol=PARAM_ATOL,
        )
