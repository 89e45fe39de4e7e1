"""The graded checks of lab 06 (ZeRO stage 2). Each runs on every rank of a real job.

The model is the toolkit's GPT in a shape whose Ψ = 11,745 parameters is odd, so at 2 ranks the flat
buffer carries one element of padding. Every rank also keeps an unwrapped copy of the same model and
trains it alone on the whole batch with plain AdamW: the reference ZeRO must reproduce.
"""
import copy
import functools

import torch

from toolkit.grading import check
from toolkit.models import SyntheticCorpus, tiny_gpt
from toolkit.parallel.flat import FlatBuffer
from toolkit.trace.events import recorder

CONFIG = dict(d_model=27, n_head=3, n_layer=1)  # Ψ = 11,745: odd, so 2 ranks pad one element
GLOBAL_BATCH, STEPS, LR = 8, 3, 1e-2
# eps=1e-6 rather than 1e-8: the attention's key bias has a gradient that is exactly zero in exact
# arithmetic (softmax ignores a shift shared by every key), so what the ranks and the one process compute
# there is rounding noise near 1e-9, which Adam with eps=1e-8 would blow up into steps of random sign a
# sizeable fraction of lr. A larger eps leaves real gradients' steps unchanged and the noise small.
OPTIMIZER = functools.partial(torch.optim.AdamW, lr=LR, eps=1e-6)
TOLERANCE = dict(rtol=1e-4, atol=1e-5)  # fp32; only the order of the sums differs from one process


def zero(student, ctx):
    """(the student's Zero2 on a fresh model, that model, an unwrapped copy with the same weights)."""
    torch.manual_seed(0)
    model = tiny_gpt(**CONFIG)
    reference = copy.deepcopy(model)
    return student.Zero2(model, OPTIMIZER, group=ctx.group), model, reference


def batch(rank, world, step=0):
    return SyntheticCorpus().batch(step, GLOBAL_BATCH, rank=rank, world_size=world)


def flat_of(tensors, world) -> torch.Tensor:
    flat = FlatBuffer([t.shape for t in tensors], world)
    flat.copy_from(tensors)
    return flat.data


def comm_events(start):
    return [e for e in recorder.events[start:] if e["cat"] == "comm"]


@check("shard_bounds: equal slices of the buffer padded to a multiple of N", points=1, world_sizes=(2,))
def bounds(student, ctx):
    for numel, world, rank, expected in ((11745, 2, 0, (0, 5873, 11746)), (11745, 2, 1, (5873, 11746, 11746)),
                                         (10, 4, 3, (9, 12, 12)), (8, 4, 1, (2, 4, 8)), (1, 3, 2, (2, 3, 3)),
                                         (7, 1, 0, (0, 7, 7))):
        got = tuple(student.shard_bounds(numel, world, rank))
        if got != expected:
            ctx.fail(f"shard_bounds({numel}, {world}, {rank}) returned {got}, expected {expected}: pad {numel} up "
                     f"to {expected[2]}, the next multiple of {world}, and give every rank {expected[2] // world} "
                     "elements")


@check("after one backward: rank r holds the average of slice r of the gradient, and no full gradient",
       points=2, world_sizes=(2,))
def gradient_slices(student, ctx):
    z, model, reference = zero(student, ctx)
    model(*batch(ctx.rank, ctx.world_size)).backward()
    reference(*batch(0, 1)).backward()
    left = [n for n, p in model.named_parameters() if p.grad is not None]
    if left:
        ctx.fail(f"rank {ctx.rank}: after backward, {len(left)} parameters still hold a full gradient ({left[:3]}, ...): "
                 "stage 2 keeps only this rank's slice; set p.grad = None once the slice is reduced")
    if z.master.grad is None:
        ctx.fail(f"rank {ctx.rank}: master.grad is None after backward: reduce_gradients must leave the reduced "
                 "slice there")
    full = flat_of([p.grad for p in reference.parameters()], ctx.world_size)
    expected = full[ctx.rank * z.flat.shard_numel:(ctx.rank + 1) * z.flat.shard_numel]
    got = z.master.grad
    if got.shape == expected.shape and not torch.allclose(got, expected, **TOLERANCE):
        ratio = (got.double().norm() / expected.double().norm().clamp_min(1e-30)).item()
        if abs(ratio - ctx.world_size) < 0.05 * ctx.world_size:
            ctx.fail(f"rank {ctx.rank}: its gradient slice is {ratio:.2f}x the whole batch's: the ranks' gradients "
                     "were summed, not averaged (reduce-scatter with op='avg')")
    ctx.expect(got, expected, f"rank {ctx.rank}'s slice of the averaged gradient", exact=False, **TOLERANCE)


@check("the optimizer holds states for this rank's slice only: 8 bytes x Ψ/N (+ the step count)",
       points=1, world_sizes=(2,))
def states_are_sharded(student, ctx):
    z, model, _ = zero(student, ctx)
    model(*batch(ctx.rank, ctx.world_size)).backward()
    z.step()
    held = sum(t.numel() * t.element_size() for s in z.optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    psi = z.flat.padded_numel
    expected = 8 * psi // ctx.world_size + 4  # exp_avg and exp_avg_sq in fp32, and a 4-byte step
    if held != expected:
        ctx.fail(f"rank {ctx.rank}: after one step the optimizer holds {held} bytes of states; for a slice of "
                 f"{psi // ctx.world_size} of the {psi} padded elements AdamW keeps {expected}. Did the step run "
                 "on the master slice alone?")


@check(f"parity: after {STEPS} steps every rank holds the parameters of plain AdamW on one process",
       points=3, world_sizes=(2,))
def parity(student, ctx):
    z, model, reference = zero(student, ctx)
    ref_opt = OPTIMIZER(reference.parameters())
    before = flat_of([p.detach().clone() for p in model.parameters()], ctx.world_size)
    for step in range(STEPS):
        model(*batch(ctx.rank, ctx.world_size, step)).backward()
        z.step()
        z.zero_grad()
        reference(*batch(0, 1, step)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if step == 0:  # after one step every slice has moved, on every rank
            now = flat_of([p.detach() for p in model.parameters()], ctx.world_size)
            still = [r for r, (a, b) in enumerate(zip(now.chunk(ctx.world_size), before.chunk(ctx.world_size)))
                     if torch.equal(a, b)]
            if still and ctx.rank not in still:
                ctx.fail(f"rank {ctx.rank}: after a step only its own slice of the parameters changed; slice(s) "
                         f"{still} still hold the old values: after the optimizer updates this rank's slice, "
                         "all-gather every rank's slice back into the flat buffer so every rank has the whole "
                         "updated model")
    for name, p in reference.named_parameters():
        ctx.expect(dict(model.named_parameters())[name].detach(), p.detach(), f"{name!r} after {STEPS} AdamW steps",
                   exact=False, **TOLERANCE)


@check("bytes per step: a reduce-scatter and an all-gather of Ψ(N-1)/N each (2Ψ as DDP), nothing else",
       points=1, world_sizes=(2,))
def bytes_per_step(student, ctx):
    z, model, _ = zero(student, ctx)
    start = len(recorder.events)
    model(*batch(ctx.rank, ctx.world_size)).backward()
    z.step()
    events = comm_events(start)
    names = sorted(e["name"] for e in events)
    if names != ["all_gather", "reduce_scatter"]:
        hint = ""
        if "all_reduce" in names:
            hint = (": an all-reduce hands every rank the whole averaged gradient, 2Ψ(N-1)/N bytes, of which "
                    "stage 2 keeps 1/N; a reduce-scatter sends half that and delivers exactly the slice")
        elif "all_gather" not in names:
            hint = ": without the all-gather after the step, each rank updates only its own slice of the model"
        ctx.fail(f"rank {ctx.rank}: a step issued {names or 'no collective'} through toolkit.comm; ZeRO-2 needs "
                 f"exactly one reduce_scatter (gradients) and one all_gather (parameters){hint}")
    n, psi = ctx.world_size, z.flat.padded_numel
    sent = sum(e["args"]["bytes_sent"] for e in events)
    theory = 2 * psi * 4 * (n - 1) // n
    if abs(sent - theory) > len(events):
        ctx.fail(f"rank {ctx.rank}: a step sent {sent} bytes; 2Ψ(N-1)/N with Ψ = {psi} padded fp32 elements and "
                 f"N = {n} is {theory}")
