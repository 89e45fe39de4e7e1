"""The graded checks of lab 02 (DDP gradient buckets). Each runs on every rank of a real job.

Every rank also trains the one-process reference ("local": the same model on the whole global batch)
by itself, so it can say exactly which parameter differs and by how much. The model is the toolkit's
tiny GPT (28,544 fp32 parameters, 114 KB of gradients); SMALL_CAP spreads it over several buckets.
"""
import copy

import torch

from toolkit.comm import collectives
from toolkit.grading import check
from toolkit.models import SyntheticCorpus, tiny_gpt
from toolkit.run import Run
from toolkit.runtime import env
from toolkit.trace.analysis import overlap_fraction
from toolkit.trace.events import recorder

SMALL_CAP_MB = 0.01   # about 10 KB: the tiny GPT's gradients fill 7 buckets
GLOBAL_BATCH = 12     # rows per step over all ranks: splits evenly over 2 and 3 ranks
STEPS, LR = 3, 0.1
# SGD with momentum, not Adam: Adam divides each gradient by its own running size, so a gradient that is
# zero in exact arithmetic (the attention's key bias) turns rounding noise into full-size steps, and two
# correct implementations that sum in different orders drift apart. SGD keeps rounding differences small.
OPTIMIZER = dict(lr=LR, momentum=0.9)


# --- helpers -------------------------------------------------------------------------------------------
def model_and_reference():
    """The tiny GPT twice, with the same weights: one to wrap, one to train alone on the whole batch."""
    torch.manual_seed(0)
    model = tiny_gpt().to(env.device())  # the CPU under gloo, this rank's GPU under NCCL
    return model, copy.deepcopy(model)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def greedy_buckets(sizes, cap):
    """What the checks expect, from sizes in bytes: last index first, a bucket closes once it reaches the cap."""
    buckets, current, total = [], [], 0
    for i in reversed(range(len(sizes))):
        current.append(i)
        total += sizes[i]
        if total >= cap:
            buckets.append(current)
            current, total = [], 0
    return buckets + [current] if current else buckets


def explain_buckets(buckets, sizes, cap) -> str:
    """Why `buckets` is not a valid bucketing of parameters of `sizes` bytes under `cap` ("" if it is)."""
    n = len(sizes)
    if not isinstance(buckets, (list, tuple)) or not all(isinstance(b, (list, tuple)) for b in buckets):
        return f"expected a list of lists of parameter indices, got {type(buckets).__name__}"
    flat = [i for b in buckets for i in b]
    if sorted(flat) != list(range(n)):
        missing = sorted(set(range(n)) - set(flat))
        twice = sorted({i for i in flat if flat.count(i) > 1})
        return (f"every parameter index 0..{n - 1} must be in exactly one bucket: "
                f"missing {missing}, more than once {twice}")
    if any(len(b) == 0 for b in buckets):
        return "a bucket is empty: every bucket holds at least one parameter"
    if flat != list(reversed(range(n))):
        return (f"buckets must hold the parameters in reverse registration order (the order backward "
                f"produces their gradients), {n - 1} first: read in order they hold {flat}")
    for k, b in enumerate(buckets):
        total = sum(sizes[i] for i in b)
        before_last = total - sizes[b[-1]]
        if before_last >= cap:
            return (f"bucket {k} {list(b)} already held {before_last} bytes >= the cap of {cap:g} before "
                    f"parameter {b[-1]} joined it: close a bucket as soon as it reaches the cap")
        if k < len(buckets) - 1 and total < cap:
            return (f"bucket {k} {list(b)} holds {total} bytes < the cap of {cap:g}, yet the next parameter "
                    "opened a new bucket: keep adding parameters until the bucket reaches the cap")
    return ""


def one_step(ddp, rank, world_size, step=0):
    """Forward and backward of this rank's rows of global batch `step`; returns the loss."""
    x, y = SyntheticCorpus().batch(step, GLOBAL_BATCH, rank=rank, world_size=world_size, device=env.device())
    loss = ddp(x, y)
    loss.backward()
    return loss


def all_reduces():
    return [e for e in recorder.events if e["cat"] == "comm" and e["name"] == "all_reduce"]


# --- the checks ----------------------------------------------------------------------------------------
@check("assign_buckets: every parameter once, last-registered first, each bucket closed once it reaches the cap",
       points=2, world_sizes=(2,))
def bucket_assignment(student, ctx):
    cases = [  # (parameter sizes in float32 elements, cap in bytes)
        ([10, 300, 5, 40, 40, 200, 7, 1], 400),
        ([10, 300, 5, 40, 40, 200, 7, 1], 1),        # tiny cap: one parameter per bucket
        ([10, 300, 5, 40, 40, 200, 7, 1], 10**9),    # huge cap: one bucket
        ([64, 64, 64, 64, 64], 512),                 # closes exactly at the cap
        ([3], 100),
    ]
    for elements, cap in cases:
        params = [torch.zeros(e) for e in elements]
        sizes = [nbytes(p) for p in params]
        got = student.assign_buckets(params, cap)
        why = explain_buckets(got, sizes, cap)
        if why:
            ctx.fail(f"assign_buckets(parameters of {sizes} bytes, cap_bytes={cap}) returned {got}: {why} "
                     f"(expected {greedy_buckets(sizes, cap)})")


@check("a small cap on the tiny GPT: several buckets, bucket 0 holding the last-registered parameters",
       points=1, world_sizes=(2,))
def buckets_of_the_model(student, ctx):
    model, _ = model_and_reference()
    ddp = student.BucketedDDP(model, bucket_cap_mb=SMALL_CAP_MB, group=ctx.group)
    names = {i: name for i, (name, _) in enumerate(model.named_parameters())}
    got = [list(b.indices) for b in ddp.buckets]
    expected = greedy_buckets([nbytes(p) for p in ddp.params], SMALL_CAP_MB * 2**20)
    if len(got) < 2:
        ctx.fail(f"bucket_cap_mb={SMALL_CAP_MB} (about {SMALL_CAP_MB * 2**20:.0f} bytes) made {len(got)} bucket(s) "
                 f"for {sum(nbytes(p) for p in ddp.params)} bytes of gradients; expected {len(expected)}")
    if got != expected:
        ctx.fail(f"buckets {got} differ from the expected {expected}; bucket 0 should start with "
                 f"{names[expected[0][0]]!r} (registered last, its gradient is ready first), "
                 f"got {names.get(got[0][0] if got and got[0] else -1, 'nothing')!r}")
    for k, b in enumerate(ddp.buckets):
        if b.buffer.numel() != sum(ddp.params[i].numel() for i in b.indices):
            ctx.fail(f"bucket {k}'s buffer has {b.buffer.numel()} elements, its parameters "
                     f"{sum(ddp.params[i].numel() for i in b.indices)}")


@check("after one backward every rank holds the gradient of the whole batch (the average over ranks)",
       points=2, world_sizes=(2, 3))
def averaged_gradients(student, ctx):
    model, reference = model_and_reference()
    ddp = student.BucketedDDP(model, bucket_cap_mb=SMALL_CAP_MB, group=ctx.group)
    one_step(ddp, ctx.rank, ctx.world_size)
    one_step(reference, 0, 1)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if p.grad is None:
            ctx.fail(f"rank {ctx.rank}: {name}.grad is None after backward")
        if not torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6):
            ratio = (p.grad.double().norm() / q.grad.double().norm().clamp_min(1e-30)).item()
            hint = ""
            if abs(ratio - ctx.world_size) < 0.05 * ctx.world_size:
                hint = (f" It is about {ctx.world_size}x too large: the ranks' gradients were summed, not "
                        "averaged (op='avg', or divide by the world size).")
            elif abs(ratio - 1) > 0.05:
                hint = f" (its norm is {ratio:.3g}x the expected one)"
            ctx.expect(p.grad, q.grad, f"gradient of {name!r} after one backward{hint}", exact=False,
                       rtol=1e-4, atol=1e-6)


@check("parity with 'local': 3 SGD steps give the parameters one process gets on the whole batch",
       points=2, world_sizes=(2, 3))
def parity_with_local(student, ctx):
    model, reference = model_and_reference()
    ddp = student.BucketedDDP(model, bucket_cap_mb=SMALL_CAP_MB, group=ctx.group)
    opt = torch.optim.SGD(ddp.parameters(), **OPTIMIZER)
    ref_opt = torch.optim.SGD(reference.parameters(), **OPTIMIZER)
    for step in range(STEPS):
        for net, optimizer, rank, world in ((ddp, opt, ctx.rank, ctx.world_size), (reference, ref_opt, 0, 1)):
            one_step(net, rank, world, step)
            optimizer.step()
            optimizer.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        ctx.expect(p.detach(), q.detach(), f"{name!r} after {STEPS} SGD steps (lr={LR}, momentum 0.9)", exact=False,
                   rtol=1e-4, atol=1e-5)


@check("overlap: buckets all-reduced asynchronously as they fill, waited for only once backward is over",
       points=2, world_sizes=(2,))
def overlap(student, ctx):
    model, _ = model_and_reference()
    log = []  # ("ready" or "wait", how many all-reduces had started by then), in the order they happened
    for p in model.parameters():  # registered before the student's: runs first, as the gradient is final
        p.register_post_accumulate_grad_hook(lambda _p: log.append(("ready", len(all_reduces()))))
    ddp = student.BucketedDDP(model, bucket_cap_mb=SMALL_CAP_MB, group=ctx.group)
    real_wait = collectives.Handle.wait

    def watched_wait(handle):
        log.append(("wait", len(all_reduces())))
        return real_wait(handle)

    recorder.reset()
    collectives.Handle.wait = watched_wait
    try:
        with recorder.span("backward"):
            one_step(ddp, ctx.rank, ctx.world_size)
    finally:
        collectives.Handle.wait = real_wait
    calls = all_reduces()
    if not calls:
        ctx.fail(f"rank {ctx.rank}: no all-reduce went through toolkit.comm during backward")
    blocking = [i for i, e in enumerate(calls) if not e["args"].get("async_op")]
    if blocking:
        ctx.fail(f"rank {ctx.rank}: all-reduce #{blocking[0]} was called with async_op=False: it blocks "
                 "until the bytes have travelled, so backward stops for it; launch with async_op=True "
                 "and keep the handle")
    last_ready = max(i for i, (kind, _) in enumerate(log) if kind == "ready")
    launched = log[last_ready][1]
    # With reverse-order buckets, every bucket without the first-registered parameters (the tied embedding,
    # whose gradient is final last) is complete before the last gradient is.
    expected = greedy_buckets([nbytes(p) for p in ddp.params], SMALL_CAP_MB * 2**20)
    ready_before_last = len(expected) - 1
    if launched < ready_before_last:
        ctx.fail(f"rank {ctx.rank}: when backward produced its last gradient, {launched} of {len(calls)} "
                 f"all-reduces had started; with reverse-order buckets {ready_before_last} of the "
                 f"{len(expected)} buckets are complete by then and should already be travelling. "
                 "Launch a bucket from the hook as soon as it is complete (and check the order of your buckets)")
    early_waits = [count for kind, count in log[:last_ready] if kind == "wait"]
    if early_waits:
        ctx.fail(f"rank {ctx.rank}: an all-reduce was waited for while backward was still running (after "
                 f"{early_waits[0]} had started): backward stalls at every bucket and nothing overlaps. "
                 "Keep the handles and wait for them in finish_backward")
    run = Run.capture(align=False)
    fraction = overlap_fraction(run, ctx.rank)
    if not fraction > 0:
        ctx.fail(f"rank {ctx.rank}: the trace shows no communication during compute (overlap fraction "
                 f"{fraction:.2f})")


@check("bytes on the wire: every gradient reduced once, 2(N-1)/N x the gradient bytes per rank",
       points=1, world_sizes=(2, 3))
def bytes_on_the_wire(student, ctx):
    model, _ = model_and_reference()
    ddp = student.BucketedDDP(model, bucket_cap_mb=SMALL_CAP_MB, group=ctx.group)
    recorder.reset()
    one_step(ddp, ctx.rank, ctx.world_size)
    comms = [e for e in recorder.events if e["cat"] == "comm"]
    others = sorted({e["name"] for e in comms} - {"all_reduce"})
    if others:
        ctx.fail(f"rank {ctx.rank}: backward issued {others} besides all_reduce; DDP needs only all-reduces")
    n = ctx.world_size
    grad_elements = sum(p.numel() for p in ddp.params)
    grad_bytes = sum(nbytes(p) for p in ddp.params)
    reduced = sum(e["args"]["numel"] for e in comms)
    if reduced != grad_elements:
        ctx.fail(f"rank {ctx.rank}: the all-reduces of one backward carried {reduced} elements, the model has "
                 f"{grad_elements} gradient elements: each gradient must travel exactly once per backward "
                 f"({'some travelled more than once' if reduced > grad_elements else 'some never did'})")
    sent = sum(e["args"]["bytes_sent"] for e in comms)
    theory = 2 * (n - 1) / n * grad_bytes
    if abs(sent - theory) > len(comms):  # the door rounds each call down to whole bytes
        ctx.fail(f"rank {ctx.rank}: sent {sent} bytes in one backward; a ring all-reduce of {grad_bytes} bytes "
                 f"of gradients sends 2(N-1)/N x {grad_bytes} = {theory:.0f}")
