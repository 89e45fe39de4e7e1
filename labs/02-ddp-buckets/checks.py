"""The graded checks of lab 02 (DDP gradient buckets), judged in the grader's process.

Each rank builds the toolkit's tiny GPT (28,544 fp32 parameters, 114 KB of gradients) from a seed drawn
for this grading, wraps it in your BucketedDDP with a cap of 0.01 MiB and trains on its own rows only
(tasks.py). Here, the same model trains alone on the whole batch: the reference a correct DDP must match,
so the messages can say which parameter differs and by how much. Buckets are judged by their rules (every
index once, last-registered first, closed once they reach the cap), not against an answer key.
"""

import re
from collections import Counter

import torch

from toolkit.grading import Fields, Items, List, Maybe, check, like, model_labs

ANSWERS = {
    "toolkit.parallel.ddp": "the toolkit's own DDP and its buckets",
    "toolkit.parallel.zero12:Zero12._bucket_params": "ZeRO-2's buckets, assign_buckets under another name",
    "toolkit.parallel.zero12:Zero12._gradient_ready": "ZeRO-2's hook that launches a bucket once it is complete",
    "torch.nn.parallel:DistributedDataParallel": "PyTorch's DDP",
}
CAP_BYTES = 0.01 * 2**20  # tasks.CAP_MB
GLOBAL_BATCH = 12  # rows per step over all ranks: splits evenly over 2 and 3 ranks
STEPS, LR = 3, 0.1
# SGD with momentum, not Adam: Adam divides each gradient by its own running size, so a gradient that is
# zero in exact arithmetic (the attention's key bias) turns rounding noise into full-size steps, and two
# correct implementations that sum in different orders drift apart. SGD keeps rounding differences small.
OPTIMIZER = dict(lr=LR, momentum=0.9)


def training(steps):
    return model_labs.training(steps, GLOBAL_BATCH, OPTIMIZER)


def local(seed, steps):
    """The reference: one process, the whole batch; after `steps` SGD steps (0: one backward)."""
    return model_labs.local(seed, steps, GLOBAL_BATCH, torch.optim.SGD, OPTIMIZER)


PARAMETERS = model_labs.parameters()  # the tiny GPT's, in registration order: BucketedDDP.params (given code)
NAMES = list(PARAMETERS)
SIZES = [p.numel() * p.element_size() for p in PARAMETERS.values()]  # bytes
BUCKETS = List(List(int), why="a list of buckets, each a list of parameter indices")
COMM = Fields({"name": str, "args": Fields({"numel": int, "bytes_sent": int}, extra=True)}, extra=True)


def explain_buckets(buckets, sizes, cap) -> str:
    """Why `buckets` is not a valid bucketing of parameters of `sizes` bytes under `cap` ("" if it is)."""
    n = len(sizes)
    flat = [i for b in buckets for i in b]
    if sorted(flat) != list(range(n)):
        missing = sorted(set(range(n)) - set(flat))
        twice = sorted({i for i in flat if flat.count(i) > 1})
        return (
            f"every parameter index 0..{n - 1} must be in exactly one bucket: missing {missing}, more than once {twice}"
        )
    if any(len(b) == 0 for b in buckets):
        return "a bucket is empty: every bucket holds at least one parameter"
    if flat != list(reversed(range(n))):
        return (
            f"buckets must hold the parameters in reverse registration order (the order backward "
            f"produces their gradients), {n - 1} first: read in order they hold {flat}"
        )
    for k, b in enumerate(buckets):
        total = sum(sizes[i] for i in b)
        before_last = total - sizes[b[-1]]
        if before_last >= cap:
            return (
                f"bucket {k} {list(b)} already held {before_last} bytes >= the cap of {cap:g} before "
                f"parameter {b[-1]} joined it: close a bucket as soon as it reaches the cap"
            )
        if k < len(buckets) - 1 and total < cap:
            return (
                f"bucket {k} {list(b)} holds {total} bytes < the cap of {cap:g}, yet the next parameter "
                "opened a new bucket: keep adding parameters until the bucket reaches the cap"
            )
    return ""


# --- the checks ----------------------------------------------------------------------------------------
CASES = [  # (parameter sizes in float32 elements, cap in bytes)
    ([10, 300, 5, 40, 40, 200, 7, 1], 400),
    ([10, 300, 5, 40, 40, 200, 7, 1], 1),  # tiny cap: one parameter per bucket
    ([10, 300, 5, 40, 40, 200, 7, 1], 10**9),  # huge cap: one bucket
    ([64, 64, 64, 64, 64], 512),  # closes exactly at the cap
    ([1, 99], 397),  # one byte short of the cap: stays open
    ([1, 99, 100], 397),  # the second bucket one byte short of the cap
    ([3], 100),
]


@check(
    "assign_buckets: every parameter once, last-registered first, each bucket closed once it reaches the cap",
    points=2,
    world_sizes=(2,),
    cases={f"{len(e)} parameters, cap {cap} bytes": {"elements": e, "cap": cap} for e, cap in CASES},
    returns={"buckets": BUCKETS},
)
def bucket_assignment(ctx, given, got):
    sizes, cap = [4 * e for e in given[0]["elements"]], given[0]["cap"]
    for r in range(ctx.world_size):
        buckets = got[r]["buckets"]
        why = explain_buckets(buckets, sizes, cap)
        if why:
            ctx.fail(f"assign_buckets(parameters of {sizes} bytes, cap_bytes={cap}) returned {buckets!r:.200}: {why}")


@check(
    "a small cap on the tiny GPT: several buckets, bucket 0 holding the last-registered parameters",
    points=1,
    world_sizes=(2,),
    inputs=training(0),
    returns={"buckets": BUCKETS, "buffers": [int]},
)
def buckets_of_the_model(ctx, given, got):
    mine = got[0]
    buckets, sizes, names = mine["buckets"], SIZES, NAMES
    if len(buckets) != len(mine["buffers"]):
        ctx.fail(f"{len(buckets)} buckets but {len(mine['buffers'])} buffers")
    if len(buckets) < 2:
        ctx.fail(
            f"bucket_cap_mb=0.01 (about {CAP_BYTES:.0f} bytes) made {len(buckets)} bucket(s) for {sum(sizes)} "
            "bytes of gradients; expected several"
        )
    why = explain_buckets(buckets, sizes, CAP_BYTES)
    if why:
        first = names[buckets[0][0]] if buckets and buckets[0] and 0 <= buckets[0][0] < len(names) else "nothing"
        ctx.fail(
            f"the buckets {buckets} of the tiny GPT: {why}; bucket 0 should start with {names[-1]!r} (registered "
            f"last, its gradient is ready first), got {first!r}"
        )
    for k, indices in enumerate(buckets):
        numel = sum(PARAMETERS[NAMES[i]].numel() for i in indices)
        if mine["buffers"][k] != numel:
            ctx.fail(f"bucket {k}'s buffer has {mine['buffers'][k]} elements, its parameters {numel}")


@check(
    "after one backward every rank holds the gradient of the whole batch (the average over ranks)",
    points=2,
    world_sizes=(2, 3),
    inputs=training(1),
    returns={"grads": {name: Maybe(like(p)) for name, p in PARAMETERS.items()}},
)
def averaged_gradients(ctx, given, got):
    reference = dict(local(given[0]["seed"], 0).named_parameters())
    for r in range(ctx.world_size):
        for name, q in reference.items():
            g = got[r]["grads"][name]
            if g is None:
                ctx.fail(f"rank {r}: {name}.grad is None after backward")
            if not torch.allclose(g, q.grad, rtol=1e-4, atol=1e-6):
                ratio = (g.double().norm() / q.grad.double().norm().clamp_min(1e-30)).item()
                hint = ""
                if abs(ratio - ctx.world_size) < 0.05 * ctx.world_size:
                    hint = (
                        f" It is about {ctx.world_size}x too large: the ranks' gradients were summed, not "
                        "averaged (op='avg', or divide by the world size)."
                    )
                elif abs(ratio - 1) > 0.05:
                    hint = f" (its norm is {ratio:.3g}x the expected one)"
                ctx.expect(
                    g,
                    q.grad,
                    f"gradient of {name!r} after one backward{hint}",
                    rank=r,
                    exact=False,
                    rtol=1e-4,
                    atol=1e-6,
                )
            ctx.expect(g, q.grad, f"gradient of {name!r} after one backward", rank=r, exact=False, rtol=1e-4, atol=1e-6)


@check(
    "parity with 'local': 3 SGD steps give the parameters one process gets on the whole batch",
    points=2,
    world_sizes=(2, 3),
    inputs=training(STEPS),
    returns={"params": {name: like(p) for name, p in PARAMETERS.items()}},
)
def parity_with_local(ctx, given, got):
    reference = local(given[0]["seed"], STEPS)
    for r in range(ctx.world_size):
        for name, q in reference.named_parameters():
            ctx.expect(
                got[r]["params"][name],
                q.detach(),
                f"{name!r} after {STEPS} SGD steps (lr={LR}, momentum 0.9)",
                rank=r,
                exact=False,
                rtol=1e-4,
                atol=1e-5,
            )


@check(
    "overlap: buckets all-reduced asynchronously as they fill, waited for only once backward is over",
    points=2,
    world_sizes=(2,),
    inputs=training(1),
    returns={"log": List(Items(str, int)), "async": [bool], "buckets": int, "overlap": float},
)
def overlap(ctx, given, got):
    for r in range(ctx.world_size):
        log, flags, buckets = [tuple(e) for e in got[r]["log"]], got[r]["async"], got[r]["buckets"]
        if not flags:
            ctx.fail(f"rank {r}: no all-reduce went through toolkit.comm during backward")
        blocking = [i for i, is_async in enumerate(flags) if not is_async]
        if blocking:
            ctx.fail(
                f"rank {r}: all-reduce #{blocking[0]} was called with async_op=False: it blocks until the bytes "
                "have travelled, so backward stops for it; launch with async_op=True and keep the handle"
            )
        last_ready = max(i for i, (kind, _) in enumerate(log) if kind == "ready")
        launched = log[last_ready][1]
        # With reverse-order buckets, every bucket without the first-registered parameters (the tied embedding,
        # whose gradient is final last) is complete before the last gradient is.
        if launched < buckets - 1:
            ctx.fail(
                f"rank {r}: when backward produced its last gradient, {launched} of {len(flags)} all-reduces had "
                f"started; with reverse-order buckets {buckets - 1} of your {buckets} buckets are complete by "
                "then and should already be travelling. Launch a bucket from the hook as soon as it is "
                "complete (and check the order of your buckets)"
            )
        early_waits = [count for kind, count in log[:last_ready] if kind == "wait"]
        if early_waits:
            ctx.fail(
                f"rank {r}: an all-reduce was waited for while backward was still running (after "
                f"{early_waits[0]} had started): backward stalls at every bucket and nothing overlaps. "
                "Keep the handles and wait for them in finish_backward"
            )
        if not got[r]["overlap"] > 0:
            ctx.fail(
                f"rank {r}: the trace shows no communication during compute (overlap fraction {got[r]['overlap']:.2f})"
            )


@check(
    "a parameter without a gradient: finish_backward raises an error that names it",
    points=1,
    world_sizes=(2,),
    inputs=lambda n, g: {"cap_mb": 1.0, "x": torch.randn(3, 4, generator=g)},
    returns={"raised": str, "message": str},
)
def unused_parameter(ctx, given, got):
    unused = {2, 3}  # the second layer's weight and bias (tasks.py): never used, so their bucket never completes
    for r in range(ctx.world_size):
        if not got[r]["raised"]:
            ctx.fail(
                f"rank {r}: a model whose second layer is never used (parameters 2 and 3 get no gradient) went "
                "through backward without an error: its bucket never completed and never travelled, so its "
                "gradients are silently missing; finish_backward must raise an error that names them"
            )
        named = {int(k) for k in re.findall(r"\d+", got[r]["message"])}
        if not unused <= named:
            ctx.fail(
                f"rank {r}: finish_backward raised {got[r]['raised']}: {got[r]['message']!r}, which does not name "
                f"the parameters without a gradient, {sorted(unused)} (those of the buckets never launched that "
                "are not ready)"
            )


def since_backward_1(comms: list, first: list, step: int) -> str:
    """For a later backward whose traffic is wrong: how its all-reduces differ from backward 1's, which were right."""
    now, before = (Counter(e["args"]["numel"] for e in calls) for calls in (comms, first))
    more, fewer = sorted((now - before).elements()), sorted((before - now).elements())
    differs = [f"extra: all-reduces of {more} elements"] if more else []
    differs += [f"missing: all-reduces of {fewer} elements"] if fewer else []
    earlier = "backward 1 was" if step == 2 else f"backwards 1 to {step - 1} were"
    return (
        f" {earlier.capitalize()} right; this one issued {sum(now.values())} all-reduces where backward 1 issued "
        f"{sum(before.values())}{' (' + '; '.join(differs) + ')' if differs else ''}. Whatever a backward changes in "
        "your wrapper, finish_backward must put back as __init__ left it: the next backward starts from there"
    )


@check(
    f"bytes on the wire: every gradient reduced once in each of {STEPS} backwards, 2(N-1)/N x the gradient bytes "
    "per rank",
    points=1,
    world_sizes=(2, 3),
    inputs=training(STEPS),
    returns={"comms": List(List(COMM), length=STEPS, why="the collectives of each backward, in order")},
)
def bytes_on_the_wire(ctx, given, got):
    n = ctx.world_size
    grad_elements, grad_bytes = sum(p.numel() for p in PARAMETERS.values()), sum(SIZES)
    theory = 2 * (n - 1) / n * grad_bytes
    for r in range(n):
        first = got[r]["comms"][0]
        for step, comms in enumerate(got[r]["comms"], 1):
            where = f"rank {r}, backward {step} of {STEPS} (the plain loop: backward, SGD step, zero_grad)"
            others = sorted({e["name"] for e in comms} - {"all_reduce"})
            if others:
                ctx.fail(f"{where}: issued {others} besides all_reduce; DDP needs only all-reduces")
            reduced = sum(e["args"]["numel"] for e in comms)
            if reduced != grad_elements:
                later = since_backward_1(comms, first, step) if step > 1 else ""
                ctx.fail(
                    f"{where}: the all-reduces carried {reduced} elements, the model has {grad_elements} gradient "
                    f"elements: each gradient must travel exactly once in every backward "
                    f"({'some travelled more than once' if reduced > grad_elements else 'some never did'}).{later}"
                )
            sent = sum(e["args"]["bytes_sent"] for e in comms)
            if abs(sent - theory) > len(comms):  # the relay rounds each call down to whole bytes
                ctx.fail(
                    f"{where}: sent {sent} bytes; a ring all-reduce of {grad_bytes} bytes of gradients sends "
                    f"2(N-1)/N x {grad_bytes} = {theory:.0f}"
                )
