"""The graded checks of lab 08 (mixed precision in FSDP). Each runs on every rank of a 2-rank job.

The student's `MixedUnit` is plugged into the toolkit's FSDP on the toolkit's tiny GPT (3 units), with
bf16 parameters for compute and communication and fp32 master weights. Every rank also keeps an
unwrapped fp32 copy of the model and trains it alone on the whole batch: the fp32 run that mixed
precision must stay close to, within the tolerance stated below.
"""
import copy
import functools

import torch

from toolkit.grading import check
from toolkit.models import SyntheticCorpus, tiny_gpt
from toolkit.parallel.flat import FlatBuffer
from toolkit.parallel.fsdp_unit import MixedPrecision
from toolkit.trace.events import recorder

BF16, FP32 = torch.bfloat16, torch.float32
GLOBAL_BATCH, STEPS, LR = 8, 4, 1e-3
OPTIMIZER = functools.partial(torch.optim.AdamW, lr=LR)
# The stated tolerance against the fp32 run. Losses near 4.1 are bf16 numbers whose spacing is 1/32,
# and the ranks' losses round differently from the whole batch's: 3 spacings. Parameters: Adam moves
# every element by about lr per step whatever its gradient's size, so an element whose gradient is
# near zero may step the other way: the largest difference is bounded only by 2·lr·STEPS; the typical
# element must agree far better (an element moves about STEPS·lr = 4e-3 in all, so a wrong update
# shows): mean |difference| below 1e-4.
LOSS_ATOL, PARAM_MAX, PARAM_MEAN = 3 / 32, 2 * LR * STEPS, 1e-4


def wrapped(student, mixed_precision=MixedPrecision(BF16)):
    torch.manual_seed(0)
    model = tiny_gpt()
    reference = copy.deepcopy(model)
    fsdp, opt = student.wrap(model, mixed_precision=mixed_precision, optimizer=OPTIMIZER)
    return fsdp, opt, reference


def batch(rank, world, step=0):
    return SyntheticCorpus().batch(step, GLOBAL_BATCH, rank=rank, world_size=world)


def comm_events(start, name=None):
    return [e for e in recorder.events[start:] if e["cat"] == "comm" and (name is None or e["name"] == name)]


def flat_of(unit, tensors: dict, dtype=FP32):
    flat = FlatBuffer(unit.flat.shapes, unit.flat.world_size, dtype=dtype)
    flat.copy_from([tensors[name].to(dtype) for name in unit.param_names])
    return flat


@check("unshard: the gathered unit is the bf16 rounding of the fp32 masters, and it travelled in bf16",
       points=2, world_sizes=(2,))
def gathered_in_bf16(student, ctx):
    fsdp, _, reference = wrapped(student)
    values = dict(reference.named_parameters())
    for unit in fsdp.units:
        start = len(recorder.events)
        unit.unshard()
        gathers = comm_events(start, "all_gather")
        if [e["args"]["dtype"] for e in gathers] != ["bfloat16"]:
            ctx.fail(f"rank {ctx.rank}: unshard() of unit {unit.name!r} all-gathered "
                     f"{[e['args']['dtype'] for e in gathers] or 'nothing'}, expected one all-gather in bfloat16: "
                     "cast the fp32 master slice to param_dtype *before* the all-gather, which is where mixed "
                     "precision halves the bytes (an fp32 gather moves 4 bytes per element, then rounds)")
        ctx.expect(unit.flat.data, flat_of(unit, values, BF16).data, f"unit {unit.name!r}'s gathered flat parameter")
        if unit.master.dtype != FP32:
            ctx.fail(f"rank {ctx.rank}: unit {unit.name!r}'s master slice is {unit.master.dtype}: it must stay fp32")
        unit.reshard()


@check("gradients are reduced in reduce_dtype: bf16 by default, fp32 with MixedPrecision(reduce_dtype=fp32)",
       points=2, world_sizes=(2,))
def reduced_in_reduce_dtype(student, ctx):
    for precision, expected in ((MixedPrecision(BF16), "bfloat16"), (MixedPrecision(BF16, FP32), "float32")):
        fsdp, _, _ = wrapped(student, precision)
        start = len(recorder.events)
        fsdp(*batch(ctx.rank, ctx.world_size)).backward()
        dtypes = sorted({e["args"]["dtype"] for e in comm_events(start, "reduce_scatter")})
        if dtypes != [expected]:
            ctx.fail(f"rank {ctx.rank}: with {precision} the gradients' reduce-scatters ran in {dtypes or 'nothing'}, "
                     f"expected {expected}: make the flat gradient buffer in reduce_dtype (add_grad), and "
                     "reduce-scatter that buffer")


@check("the optimizer sees fp32: masters and gradient slices fp32, micro-batches accumulated in fp32",
       points=1, world_sizes=(2,))
def fp32_for_the_optimizer(student, ctx):
    fsdp, _, reference = wrapped(student, MixedPrecision(BF16, FP32))
    for step in range(2):  # two micro-batches, one step
        fsdp(*batch(ctx.rank, ctx.world_size, step)).backward()
        reference(*batch(0, 1, step)).backward()
    grads = {n: p.grad for n, p in reference.named_parameters()}
    for unit in fsdp.units:
        got = unit.mine.grad
        if got is None or got.dtype != FP32:
            ctx.fail(f"rank {ctx.rank}: unit {unit.name!r}'s gradient slice is "
                     f"{'missing' if got is None else got.dtype}; finish_reduce must leave an fp32 slice in "
                     "self.mine.grad (the optimizer steps fp32 masters)")
        expected = flat_of(unit, grads).shard(unit.sharding.rank)
        scale = expected.abs().max().item()
        worst = (got - expected).abs().max().item()
        if worst > 0.05 * scale:  # bf16 compute: about 1% per gradient; a lost micro-batch is about 50%
            ctx.fail(f"rank {ctx.rank}: after two backwards unit {unit.name!r}'s gradient slice differs from the fp32 "
                     f"sum of both micro-batches' gradients by up to {worst:.3g} (largest gradient {scale:.3g}): "
                     "add each backward's reduced slice into self.mine.grad instead of replacing it")


@check(f"{STEPS} AdamW steps stay within the stated tolerance of the fp32 run (losses and parameters)",
       points=2, world_sizes=(2,))
def close_to_fp32(student, ctx):
    fsdp, opt, reference = wrapped(student)
    ref_opt = OPTIMIZER(reference.parameters())
    losses = []
    for step in range(STEPS):
        loss = fsdp(*batch(ctx.rank, ctx.world_size, step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = reference(*batch(0, 1, step))
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((loss.float().item(), ref_loss.item()))
    for step, (mine, fp32) in enumerate(losses):
        if abs(mine - fp32) > LOSS_ATOL:
            ctx.fail(f"rank {ctx.rank}: step {step}'s loss is {mine:.4f} against the fp32 run's {fp32:.4f}; bf16 "
                     f"allows {LOSS_ATOL:.3f} (3 of bf16's spacings near 4)")
    got = fsdp.full_state_dict()
    diffs = torch.cat([(got[n].float() - p.detach()).abs().flatten() for n, p in reference.named_parameters()])
    if any(got[n].dtype != FP32 for n in got):
        ctx.fail(f"rank {ctx.rank}: the trained parameters are not fp32: the masters must stay fp32")
    if diffs.max() > PARAM_MAX or diffs.mean() > PARAM_MEAN:
        ctx.fail(f"rank {ctx.rank}: after {STEPS} steps the parameters differ from the fp32 run's by "
                 f"{diffs.mean():.2e} on average (tolerance {PARAM_MEAN:.0e}) and {diffs.max():.2e} at most "
                 f"(tolerance {PARAM_MAX:.0e}): are the masters fp32, and the reduced gradients cast to fp32?")


@check("bytes halved: a bf16 step moves half the bytes of the fp32 step, 3Ψ(N-1)/N x 2", points=1,
       world_sizes=(2,))
def bytes_halved(student, ctx):
    fsdp, opt, _ = wrapped(student)
    start = len(recorder.events)
    fsdp(*batch(ctx.rank, ctx.world_size)).backward()
    opt.step()
    events = comm_events(start)
    n = ctx.world_size
    psi = sum(u.flat.padded_numel for u in fsdp.units)
    sent = sum(e["args"]["bytes_sent"] for e in events)
    fp32 = 3 * psi * 4 * (n - 1) // n
    if abs(sent - fp32 / 2) > len(events):
        ctx.fail(f"rank {ctx.rank}: a bf16 step sent {sent} bytes; the fp32 step sends 3Ψ(N-1)/N x 4 = {fp32} "
                 f"(Ψ = {psi} padded elements), so bf16 should send {fp32 // 2}")
