"""The graded checks of lab 03 (one FSDP unit). Each runs on every rank of a real job.

The student's `MyUnit` is plugged into the toolkit's FSDP (`student.wrap`, i.e. `unit_class=MyUnit`) on
the toolkit's tiny GPT: 3 units (the root with the tied embedding, and one per block). Every rank also
keeps an unwrapped copy of the same model and trains it alone on the whole batch: the reference a
correct FSDP must match. At 3 ranks the flat parameters are padded (a block's 12,704 elements are not a
multiple of 3), so a unit that forgets the padding shows there.
"""
import copy
import functools

import torch

from toolkit.grading import check
from toolkit.models import SyntheticCorpus, tiny_gpt
from toolkit.parallel.flat import FlatBuffer
from toolkit.runtime import env
from toolkit.trace.events import recorder

GLOBAL_BATCH = 12     # rows per step over all ranks: splits evenly over 2 and 3 ranks
STEPS, LR = 3, 0.1
# SGD with momentum, not Adam: Adam divides each gradient by its own running size, so it would hide a
# gradient N times too large (summed, not averaged), and it turns rounding noise in gradients that are
# zero in exact arithmetic into full-size steps. SGD keeps both visible and small, respectively.
OPTIMIZER = functools.partial(torch.optim.SGD, lr=LR, momentum=0.9)


# --- helpers -------------------------------------------------------------------------------------------
def wrapped(student, **options):
    """(FSDP model with the student's units, its optimizer, an unwrapped copy with the same weights)."""
    torch.manual_seed(0)
    model = tiny_gpt().to(env.device())
    reference = copy.deepcopy(model)
    fsdp, opt = student.wrap(model, optimizer=OPTIMIZER, **options)
    return fsdp, opt, reference


def batch(rank, world, step=0):
    return SyntheticCorpus().batch(step, GLOBAL_BATCH, rank=rank, world_size=world, device=env.device())


def nbytes(unit) -> int:
    """Bytes the unit's gathered flat parameter holds right now (0 when freed)."""
    return unit.flat.data.untyped_storage().nbytes()


def full_bytes(unit) -> int:
    return unit.flat.padded_numel * unit.flat.data.element_size()


def comm_events(start: int) -> list:
    return [e for e in recorder.events[start:] if e["cat"] == "comm"]


def expect_values(ctx, unit, reference, what):
    """Every parameter of the unit (a view into the flat parameter) equals the reference's."""
    values = dict(reference.named_parameters())
    for name, p in zip(unit.param_names, unit.params):
        ctx.expect(p.detach(), values[name].detach(), f"{what}: parameter {name!r} of unit {unit.name!r}")


# --- the checks ----------------------------------------------------------------------------------------
@check("unshard: the all-gather fills the full flat parameter (blocking, and asynchronous until wait_unshard)",
       points=2, world_sizes=(2, 3))
def unshard_gathers(student, ctx):
    fsdp, _, reference = wrapped(student)
    for unit in fsdp.units:
        start = len(recorder.events)
        unit.unshard()
        if unit.state != "gathered":
            ctx.fail(f"rank {ctx.rank}: after unshard(), unit {unit.name!r} is in state {unit.state!r}, expected "
                     "'gathered' (set self.state = GATHERED once the all-gather is done)")
        if nbytes(unit) != full_bytes(unit):
            ctx.fail(f"rank {ctx.rank}: after unshard(), the flat parameter of unit {unit.name!r} holds "
                     f"{nbytes(unit)} bytes, expected {full_bytes(unit)} ({unit.flat.padded_numel} elements of "
                     f"{unit.flat.data.element_size()} bytes): resize its storage back before gathering into it")
        gathers = [e for e in comm_events(start) if e["name"] == "all_gather"]
        if len(gathers) != 1:
            ctx.fail(f"rank {ctx.rank}: unshard() of unit {unit.name!r} issued {len(gathers)} all-gathers through "
                     "toolkit.comm, expected exactly 1 (comm.all_gather of the master slice into the flat parameter)")
        expect_values(ctx, unit, reference, "after unshard()")
        unit.reshard()
    unit = fsdp.units[-1]  # asynchronous: in flight until wait_unshard
    start = len(recorder.events)
    unit.unshard(async_op=True)
    gathers = [e for e in comm_events(start) if e["name"] == "all_gather"]
    if not gathers or not gathers[0]["args"].get("async_op"):
        ctx.fail(f"rank {ctx.rank}: unshard(async_op=True) must issue its all-gather with async_op=True and return "
                 "at once (the handle lets wait_unshard finish it later): that is what prefetching is")
    if unit.state != "gathering":
        ctx.fail(f"rank {ctx.rank}: right after unshard(async_op=True) the unit is {unit.state!r}, expected "
                 "'gathering' until wait_unshard() has waited for the handle")
    unit.wait_unshard()
    if unit.state != "gathered":
        ctx.fail(f"rank {ctx.rank}: after wait_unshard() the unit is {unit.state!r}, expected 'gathered'")
    expect_values(ctx, unit, reference, "after unshard(async_op=True) and wait_unshard()")
    unit.reshard()


@check("reshard frees: 0 bytes after reshard, after forward and after backward; gathered while its module runs",
       points=2, world_sizes=(2,))
def memory_is_freed(student, ctx):
    fsdp, _, reference = wrapped(student, forward_prefetch=True)
    for unit in fsdp.units:
        unit.unshard()
        unit.reshard()
        if nbytes(unit) != 0:
            ctx.fail(f"rank {ctx.rank}: after reshard(), unit {unit.name!r}'s flat parameter still holds "
                     f"{nbytes(unit)} bytes: free it with self.flat.data.untyped_storage().resize_(0) (the "
                     "tensor and its views stay valid, only the memory goes)")
        if unit.state != "sharded":
            ctx.fail(f"rank {ctx.rank}: after reshard(), unit {unit.name!r} is in state {unit.state!r}, "
                     "expected 'sharded'")
    seen = {}

    def note(unit, module, args):  # registered after FSDP's hooks: runs once the unit is gathered
        seen.setdefault(unit.name, (unit.state, nbytes(unit)))

    for unit in fsdp.units:
        unit.module.register_forward_pre_hook(functools.partial(note, unit))
    x, y = batch(ctx.rank, ctx.world_size)
    loss = fsdp(x, y)
    for unit in fsdp.units:
        state, held = seen.get(unit.name, (None, 0))
        if state != "gathered":
            ctx.fail(f"rank {ctx.rank}: unit {unit.name!r}'s module ran while the unit was {state!r}, not 'gathered': "
                     "a prefetched unit's all-gather is still in flight when FSDP calls unshard() for it, and "
                     "unshard() (without async_op) must then wait for it (wait_unshard) before returning")
        if held != full_bytes(unit):
            ctx.fail(f"rank {ctx.rank}: while unit {unit.name!r}'s module ran, its flat parameter held {held} bytes, "
                     f"expected {full_bytes(unit)}")
    kept = {u.name: nbytes(u) for u in fsdp.units if nbytes(u)}
    if kept:
        ctx.fail(f"rank {ctx.rank}: after forward, the gathered parameters of units {kept} (bytes) were not freed: "
                 "FSDP calls reshard() right after each unit's forward, and reshard must resize the storage to 0")
    loss.backward()
    kept = {u.name: nbytes(u) for u in fsdp.units if nbytes(u)}
    if kept:
        ctx.fail(f"rank {ctx.rank}: after backward, units {kept} (bytes) still hold their gathered parameters")


@check("per step, every unit: 2 all-gathers (forward, backward) and 1 reduce-scatter, nothing else",
       points=2, world_sizes=(2, 3))
def collectives_per_unit(student, ctx):
    fsdp, opt, _ = wrapped(student)
    x, y = batch(ctx.rank, ctx.world_size)
    start = len(recorder.events)
    fsdp(x, y).backward()
    opt.step()
    opt.zero_grad()
    events = comm_events(start)
    if not events:
        ctx.fail(f"rank {ctx.rank}: no collective went through toolkit.comm in a training step (use comm.all_gather "
                 "and comm.reduce_scatter, not torch.distributed directly)")
    names = sorted({e["name"] for e in events} - {"all_gather", "reduce_scatter"})
    if names:
        ctx.fail(f"rank {ctx.rank}: a step issued {names} besides all-gathers and reduce-scatters")
    units = sorted(u.flat.padded_numel for u in fsdp.units)
    for op, per_unit in (("all_gather", 2), ("reduce_scatter", 1)):
        sizes = sorted(e["args"]["numel"] for e in events if e["name"] == op)
        if sizes != sorted(units * per_unit):
            ctx.fail(f"rank {ctx.rank}: the {op}s of one step moved flat tensors of {sizes} elements; with "
                     f"{len(units)} units of {units} padded elements, expected each unit {per_unit} time(s): "
                     f"{sorted(units * per_unit)}")


@check("bytes on the wire: 3Ψ(N-1)/N per rank per step (Ψ the padded elements, 4 bytes each)",
       points=1, world_sizes=(2, 3))
def bytes_per_step(student, ctx):
    fsdp, opt, _ = wrapped(student)
    x, y = batch(ctx.rank, ctx.world_size)
    start = len(recorder.events)
    fsdp(x, y).backward()
    opt.step()
    n = ctx.world_size
    psi = sum(u.flat.padded_numel for u in fsdp.units)
    sent = sum(e["args"]["bytes_sent"] for e in comm_events(start))
    theory = 3 * psi * 4 * (n - 1) / n
    if abs(sent - theory) > len(comm_events(start)):  # the door rounds each call down to whole bytes
        ctx.fail(f"rank {ctx.rank}: a step sent {sent} bytes; 3Ψ(N-1)/N with Ψ = {psi} padded elements of 4 bytes "
                 f"and N = {n} is {theory:.0f}")


@check("after one backward each rank holds its slice of the whole batch's gradient (the average over ranks)",
       points=2, world_sizes=(2, 3))
def averaged_gradient_slices(student, ctx):
    fsdp, _, reference = wrapped(student)
    x, y = batch(ctx.rank, ctx.world_size)
    fsdp(x, y).backward()
    rx, ry = batch(0, 1)
    reference(rx, ry).backward()
    grads = {name: p.grad for name, p in reference.named_parameters()}
    for unit in fsdp.units:
        expected_flat = FlatBuffer(unit.flat.shapes, unit.flat.world_size)
        expected_flat.copy_from([grads[name] for name in unit.param_names])
        expected = expected_flat.shard(unit.sharding.rank)
        got = unit.mine.grad
        if got is None:
            ctx.fail(f"rank {ctx.rank}: unit {unit.name!r} has no gradient slice after backward: did reduce_grad "
                     "leave (handle, output, input) in self.reduction?")
        if not torch.allclose(got, expected, rtol=1e-4, atol=1e-6):
            ratio = (got.double().norm() / expected.double().norm().clamp_min(1e-30)).item()
            hint = ""
            if abs(ratio - ctx.world_size) < 0.05 * ctx.world_size:
                hint = (f" It is about {ctx.world_size}x too large: the ranks' gradients were summed, not averaged "
                        "(reduce-scatter with op='avg').")
            ctx.expect(got, expected, f"gradient slice of unit {unit.name!r} on rank {ctx.rank}{hint}", exact=False,
                       rtol=1e-4, atol=1e-6)


@check("parity with 'local': 3 SGD steps (with forward and backward prefetch) give one process's parameters",
       points=2, world_sizes=(2, 3))
def parity_with_local(student, ctx):
    fsdp, opt, reference = wrapped(student, forward_prefetch=True, backward_prefetch=True)
    ref_opt = OPTIMIZER(reference.parameters())
    for step in range(STEPS):
        for net, optimizer, rank, world in ((fsdp, opt, ctx.rank, ctx.world_size), (reference, ref_opt, 0, 1)):
            x, y = batch(rank, world, step)
            net(x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
    got = fsdp.full_state_dict()
    for name, p in reference.named_parameters():
        ctx.expect(got[name].detach().float(), p.detach(), f"{name!r} after {STEPS} SGD steps (lr={LR}, momentum 0.9)",
                   exact=False, rtol=1e-4, atol=1e-5)
