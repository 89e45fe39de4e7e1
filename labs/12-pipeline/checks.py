"""The graded checks of lab 12 (1F1B's action list). Each runs on every rank of a real job.

The first five read the student's lists for pp = 2, 3, 4 and m = pp and 2·pp + 1 without running a model:
well-formed, 1F1B's warm-up, its memory bound, no deadlock and its bubble in a dry run (every rank's list
stepped on a clock, a forward costing 1 and a backward 2, a receive waiting for its send:
`toolkit.parallel.pipeline.lowering.replay`). The last runs the lists on real ranks at pp = 2, 3, 4: the
toolkit's driver trains a tiny GPT with them, which must equal one process's training.
"""
import torch

import toolkit
from toolkit.grading import check
from toolkit.models import SyntheticCorpus, tiny_gpt
from toolkit.parallel.pipeline import bubble, lowering, schedules
from toolkit.trace.events import recorder

LAYOUTS = [(pp, m) for pp in (2, 3, 4) for m in (pp, 2 * pp + 1)]
MODEL = dict(n_layer=12, d_model=16, n_head=2, seq_len=16)  # 12 blocks: 6, 4 or 3 per stage at pp = 2, 3, 4
TOLERANCE = dict(rtol=1e-5, atol=1e-5)  # fp32: the micro-batches' sums in another order (tests/test_pipeline.py)


def lists(student, pp: int, m: int) -> list:
    """Every rank's list, as Actions (a plain (kind, micro, stage) tuple is accepted too)."""
    out = []
    for rank in range(pp):
        got = student.one_f_one_b(pp, m, rank)
        if not isinstance(got, (list, tuple)):
            raise TypeError(f"one_f_one_b({pp}, {m}, {rank}) returned a {type(got).__name__}; return a list of "
                            f"Action(kind, micro, stage)")
        out.append([schedules.Action(*a) for a in got])
    return out


def well_formed(student, ctx, pp: int, m: int) -> list:
    try:
        actions = lists(student, pp, m)
        schedules.check(actions, pp, m)
    except (TypeError, ValueError) as exc:
        ctx.fail(f"pp={pp}, microbatches={m}: {exc}")
    return actions


@check("every micro-batch's forward and backward, once each, the backward after the forward", points=1,
       world_sizes=(2,))
def complete(student, ctx):
    for pp, m in LAYOUTS:
        well_formed(student, ctx, pp, m)


@check("warm-up: rank r runs min(pp - r - 1, m) forwards before its first backward, then alternates", points=1,
       world_sizes=(2,))
def warm_up(student, ctx):
    for pp, m in LAYOUTS:
        for rank, mine in enumerate(well_formed(student, ctx, pp, m)):
            kinds = "".join(a.kind for a in mine)
            warmup = min(pp - rank - 1, m)
            expected = "F" * warmup + "FB" * (m - warmup) + "B" * warmup
            if kinds != expected:
                ctx.fail(f"pp={pp}, microbatches={m}, rank {rank} runs {kinds} ({schedules.show([mine])[8:]}); "
                         f"1F1B's rank {rank} runs {warmup} warm-up forward(s) (pp - rank - 1: the stages after it "
                         f"must fill before its first gradient can come back), then forward/backward pairs, then "
                         f"the remaining backwards: {expected}")


@check("memory: rank r never holds more than pp - r micro-batches' activations", points=1, world_sizes=(2,))
def memory(student, ctx):
    for pp, m in LAYOUTS:
        for rank, mine in enumerate(well_formed(student, ctx, pp, m)):
            held, bound = bubble.in_flight(mine), bubble.formula_in_flight("1f1b", pp, m, rank)
            if held > bound:
                ctx.fail(f"pp={pp}, microbatches={m}: rank {rank} holds {held} micro-batches' activations at once "
                         f"(forwards run whose backward has not); 1F1B holds at most pp - rank = {bound}: each "
                         f"backward frees one before the next forward. All forwards first is GPipe: m on every rank")


@check("no deadlock: a dry run of every rank's list completes", points=1, world_sizes=(2,))
def no_deadlock(student, ctx):
    for pp, m in LAYOUTS:
        actions = well_formed(student, ctx, pp, m)
        try:
            lowering.replay(lowering.lower(actions, pp), lowering.unit_cost(False))
        except lowering.PipelineDeadlock as exc:
            ctx.fail(f"pp={pp}, microbatches={m}: {exc}")


@check("the bubble: (pp - 1) / (m + pp - 1) of the step, in a dry run", points=1, world_sizes=(2,))
def bubble_size(student, ctx):
    for pp, m in LAYOUTS:
        actions = well_formed(student, ctx, pp, m)
        try:
            timeline = lowering.replay(lowering.lower(actions, pp), lowering.unit_cost(False))
        except lowering.PipelineDeadlock as exc:
            ctx.fail(f"pp={pp}, microbatches={m}: the schedule deadlocks, so it has no bubble to measure: {exc}")
        busy, span = lowering.busy_and_span(timeline)
        idle, formula = 1 - busy[0] / span, bubble.formula_bubble("1f1b", pp, m)
        if abs(idle - formula) > 1e-9:
            ctx.fail(f"pp={pp}, microbatches={m}: rank 0 idles {idle:.1%} of the step in a dry run (forward 1, "
                     f"backward 2); 1F1B's bubble is (pp-1)/(m+pp-1) = {formula:.1%}. A rank that waits for a "
                     f"gradient it could have had earlier, or runs a forward late, stretches the step")


def train(model, opt, steps: int, rows: int, pp: bool) -> list:
    losses = []
    for step in range(steps):
        x, y = SyntheticCorpus(seq_len=MODEL["seq_len"]).batch(step, rows)
        if pp:
            loss = model.forward_backward(x, y)
        else:
            loss = model(x, y)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


@check("on real ranks, pp = 2, 3, 4: your lists train a 12-block GPT as one process does", points=2,
       world_sizes=(2, 3, 4))
def real_ranks(student, ctx):
    pp, m = ctx.world_size, 2 * ctx.world_size
    torch.manual_seed(0)
    reference = tiny_gpt(**MODEL)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    expected = train(reference, ref_opt, 2, m, pp=False)
    torch.manual_seed(0)
    sgd = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    try:
        model, opt = toolkit.parallel.wrap(tiny_gpt(**MODEL), "local", optimizer=sgd, pp=pp, microbatches=m,
                                           schedule=student.one_f_one_b)
    except lowering.PipelineDeadlock as exc:
        ctx.fail(f"rank {ctx.rank}: the toolkit's driver refused to run your lists at pp={pp}: {exc}")
    start = len(recorder.events)
    got = train(model, opt, 2, m, pp=True)
    ran = [f"{e['args']['stage']}{e['args']['action']}{e['args']['micro']}" for e in recorder.events[start:]
           if e["cat"] == "compute" and "action" in e["args"] and e["args"]["step"] == 1]
    mine = [repr(schedules.Action(*a)) for a in student.one_f_one_b(pp, m, ctx.rank)]
    if ran != mine:
        ctx.fail(f"rank {ctx.rank} ran {ran}, not its list {mine}")
    for step, (loss, ref) in enumerate(zip(got, expected)):
        ctx.expect(loss, ref, f"pp={pp}: the loss of step {step}", exact=False, **TOLERANCE)
    state, ref_state = toolkit.parallel.full_state_dict(model), dict(reference.named_parameters())
    for name, value in ref_state.items():
        ctx.expect(state[name], value.detach(), f"pp={pp}: {name} after 2 steps", exact=False, **TOLERANCE)
