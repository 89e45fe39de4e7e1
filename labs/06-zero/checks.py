"""The graded checks of lab 06 (ZeRO stage 2), judged in the grader's process.

The model is the toolkit's GPT in a shape whose Ψ = 11,745 parameters is odd, so at 2 ranks the flat
buffer carries one element of padding; its weights come from a seed drawn for this grading. Each rank
trains it under your Zero2 on its own rows (tasks.py); here the same model trains alone on the whole batch
with plain AdamW: the reference ZeRO must reproduce.
"""

import math

import torch

from toolkit.grading import Fields, Items, Maybe, Tensor, check, like, model_labs
from toolkit.parallel.flat import FlatBuffer

ANSWERS = {
    "toolkit.parallel.zero": "the toolkit's own ZeRO",
    "toolkit.parallel.zero12": "the toolkit's own ZeRO stages 1 and 2",
    "toolkit.parallel.optimizer_sharding": "the toolkit's own sharded optimizer",
    "toolkit.parallel.zero3": "the toolkit's own ZeRO stage 3",
    "torch.distributed.optim:ZeroRedundancyOptimizer": "PyTorch's sharded optimizer",
}
CONFIG = dict(d_model=27, n_head=3, n_layer=1)  # Ψ = 11,745: odd, so 2 ranks pad one element
GLOBAL_BATCH, STEPS, LR = 8, 3, 1e-2
# eps=1e-6 rather than 1e-8: the attention's key bias has a gradient that is exactly zero in exact
# arithmetic (softmax ignores a shift shared by every key), so what the ranks and the one process compute
# there is rounding noise near 1e-9, which Adam with eps=1e-8 would blow up into steps of random sign a
# sizeable fraction of lr. A larger eps leaves real gradients' steps unchanged and the noise small.
OPTIMIZER = dict(lr=LR, eps=1e-6)
TOLERANCE = dict(rtol=1e-4, atol=1e-5)  # fp32; only the order of the sums differs from one process


def training(steps):
    return model_labs.training(steps, GLOBAL_BATCH, OPTIMIZER, config=CONFIG)


def local(seed, steps):
    """The reference: plain AdamW in one process on the whole batch (0 steps: after one backward)."""
    return model_labs.local(seed, steps, GLOBAL_BATCH, torch.optim.AdamW, OPTIMIZER, CONFIG)


def flat_of(tensors, world) -> torch.Tensor:
    flat = FlatBuffer([t.shape for t in tensors], world)
    flat.copy_from(tensors)
    return flat.data


PARAMETERS = model_labs.parameters(CONFIG)
PSI = sum(p.numel() for p in PARAMETERS.values())  # 11,745


def padded(world: int) -> int:
    """Ψ padded to a multiple of the world size: the flat buffer ZeRO splits (FlatBuffer, given)."""
    return math.ceil(PSI / world) * world


COMM = Fields({"name": str, "args": Fields({"bytes_sent": int}, extra=True)}, extra=True)


def _bounds_cases(n, g):
    """The model's Ψ at 2 ranks, edge cases (fewer elements than ranks, one rank, an exact multiple), and a few
    drawn for this grading."""
    cases = [(PSI, 2, 0), (PSI, 2, 1), (10, 4, 3), (8, 4, 1), (1, 3, 2), (7, 1, 0)]
    for _ in range(4):
        world = int(torch.randint(2, 9, (), generator=g))
        cases.append(
            (int(torch.randint(1, 100_000, (), generator=g)), world, int(torch.randint(0, world, (), generator=g)))
        )
    return {
        f"shard_bounds({numel}, {world}, {rank})": {"numel": numel, "world_size": world, "rank": rank}
        for numel, world, rank in cases
    }


@check(
    "shard_bounds: equal slices of the buffer padded to a multiple of N",
    points=1,
    world_sizes=(2,),
    pure=True,
    cases=_bounds_cases,
    returns={"bounds": Items(int, int, int, why="shard_bounds returns (start, end, padded)")},
)
def bounds(ctx, given, got):
    numel, world, rank = given[0]["numel"], given[0]["world_size"], given[0]["rank"]
    size = math.ceil(numel / world)
    expected = (rank * size, (rank + 1) * size, size * world)
    if tuple(got[0]["bounds"]) != expected:
        ctx.fail(
            f"shard_bounds({numel}, {world}, {rank}) returned {tuple(got[0]['bounds'])}, expected {expected}: pad "
            f"{numel} up to {expected[2]}, the next multiple of {world}, and give every rank {size} elements"
        )


@check(
    "after one backward: rank r holds the average of slice r of the gradient, and no full gradient",
    points=2,
    world_sizes=(2,),
    inputs=training(1),
    returns=lambda case, r, n: {"full_left": [str], "grad": Maybe(Tensor((padded(n) // n,), torch.float32))},
)
def gradient_slices(ctx, given, got):
    reference = local(given[0]["seed"], 0)
    full = flat_of([p.grad for p in reference.parameters()], ctx.world_size)
    for r in range(ctx.world_size):
        mine = got[r]
        if mine["full_left"]:
            ctx.fail(
                f"rank {r}: after backward, {len(mine['full_left'])} parameters still hold a full gradient "
                f"({mine['full_left'][:3]}, ...): stage 2 keeps only this rank's slice; set p.grad = None once "
                "the slice is reduced"
            )
        if mine["grad"] is None:
            ctx.fail(
                f"rank {r}: master.grad is None after backward: reduce_gradients must leave the reduced slice there"
            )
        shard = padded(ctx.world_size) // ctx.world_size
        expected, grad = full[r * shard : (r + 1) * shard], mine["grad"]
        if not torch.allclose(grad, expected, **TOLERANCE):
            ratio = (grad.double().norm() / expected.double().norm().clamp_min(1e-30)).item()
            if abs(ratio - ctx.world_size) < 0.05 * ctx.world_size:
                ctx.fail(
                    f"rank {r}: its gradient slice is {ratio:.2f}x the whole batch's: the ranks' gradients were "
                    "summed, not averaged (reduce-scatter with op='avg')"
                )
        ctx.expect(grad, expected, f"rank {r}'s slice of the averaged gradient", rank=r, exact=False, **TOLERANCE)


@check(
    "the optimizer holds states for this rank's slice only: 8 bytes x Ψ/N (+ the step count), and no gradient "
    "after its step",
    points=1,
    world_sizes=(2,),
    inputs=training(1),
    returns={"held": int, "gradient_kept": bool},
)
def states_are_sharded(ctx, given, got):
    for r in range(ctx.world_size):
        held, psi = got[r]["held"], padded(ctx.world_size)
        expected = 8 * psi // ctx.world_size + 4  # exp_avg and exp_avg_sq in fp32, and a 4-byte step
        if held != expected:
            ctx.fail(
                f"rank {r}: after one step the optimizer holds {held} bytes of states; for a slice of "
                f"{psi // ctx.world_size} of the {psi} padded elements AdamW keeps {expected}. Did the step run "
                "on the master slice alone?"
            )
        if got[r]["gradient_kept"]:
            ctx.fail(
                f"rank {r}: after step(), master.grad still holds the slice's gradient: used, it is dropped "
                "(self.master.grad = None), so stage 2 keeps no gradient from one step to the next"
            )


def trained(case, r, n):
    flat = Tensor((padded(n),), torch.float32)
    return {"before": flat, "after_first": flat, "params": {name: like(p) for name, p in PARAMETERS.items()}}


@check(
    f"parity: after {STEPS} steps every rank holds the parameters of plain AdamW on one process",
    points=3,
    world_sizes=(2,),
    inputs=training(STEPS),
    returns=trained,
)
def parity(ctx, given, got):
    reference = local(given[0]["seed"], STEPS)
    n = ctx.world_size
    for r in range(n):
        before, now = got[r]["before"], got[r]["after_first"]
        still = [s for s, (a, b) in enumerate(zip(now.chunk(n), before.chunk(n))) if torch.equal(a, b)]
        if still and r not in still:  # after one step every slice has moved, on every rank
            ctx.fail(
                f"rank {r}: after a step only its own slice of the parameters changed; slice(s) {still} still "
                "hold the old values: after the optimizer updates this rank's slice, all-gather every rank's "
                "slice back into the flat buffer so every rank has the whole updated model"
            )
        for name, p in reference.named_parameters():
            ctx.expect(
                got[r]["params"][name],
                p.detach(),
                f"{name!r} after {STEPS} AdamW steps",
                rank=r,
                exact=False,
                **TOLERANCE,
            )


@check(
    "bytes per step: a reduce-scatter and an all-gather of Ψ(N-1)/N each (2Ψ as DDP), nothing else",
    points=1,
    world_sizes=(2,),
    inputs=training(1),
    returns={"comms": [COMM]},
)
def bytes_per_step(ctx, given, got):
    n = ctx.world_size
    for r in range(n):
        events, psi = got[r]["comms"], padded(n)
        names = sorted(e["name"] for e in events)
        if names != ["all_gather", "reduce_scatter"]:
            hint = ""
            if "all_reduce" in names:
                hint = (
                    ": an all-reduce hands every rank the whole averaged gradient, 2Ψ(N-1)/N bytes, of which "
                    "stage 2 keeps 1/N; a reduce-scatter sends half that and delivers exactly the slice"
                )
            elif "all_gather" not in names:
                hint = ": without the all-gather after the step, each rank updates only its own slice of the model"
            ctx.fail(
                f"rank {r}: a step made the grader's relay carry {names or 'no collective'}; ZeRO-2 needs "
                f"exactly one reduce_scatter (gradients) and one all_gather (parameters){hint}"
            )
        sent = sum(e["args"]["bytes_sent"] for e in events)
        theory = 2 * psi * 4 * (n - 1) // n
        if abs(sent - theory) > len(events):
            ctx.fail(
                f"rank {r}: a step sent {sent} bytes; 2Ψ(N-1)/N with Ψ = {psi} padded fp32 elements and "
                f"N = {n} is {theory}"
            )
