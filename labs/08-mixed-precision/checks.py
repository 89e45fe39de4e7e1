"""The graded checks of lab 08 (mixed precision in FSDP), judged in the grader's process. Every check runs on
2 ranks.

Each rank plugs your `MixedUnit` into the toolkit's FSDP on the toolkit's tiny GPT (3 units), built from a
seed drawn for this grading, with bf16 parameters for compute and communication and fp32 master weights
(tasks.py). Here an fp32 copy of the model trains alone on the whole batch: the fp32 run that mixed
precision must stay close to, within the tolerance stated below.
"""

import torch

from toolkit.grading import Fields, List, Maybe, Tensor, check, model_labs
from toolkit.models import SyntheticCorpus, tiny_gpt
from toolkit.parallel.flat import FlatBuffer

ANSWERS = {
    "toolkit.parallel.fsdp_unit:FSDPUnit.unshard": "the toolkit's own unshard",
    "toolkit.parallel.fsdp_unit:FSDPUnit.add_grad": "the toolkit's own gradient buffer",
    "toolkit.parallel.fsdp_unit:FSDPUnit.reduce_grad": "the toolkit's own gradient reduction",
    "toolkit.parallel.fsdp_unit:FSDPUnit.finish_reduce": "the toolkit's own gradient reduction",
}
BUILDS_ON = [
    "toolkit.parallel.fsdp_unit:FSDPUnit.wait_unshard",
    "toolkit.parallel.fsdp_unit:FSDPUnit.reshard",
    "toolkit.parallel.fsdp_unit:sharding_groups",
]  # FSDP's groups (lab 07's), hybrid or not
BF16, FP32 = torch.bfloat16, torch.float32
GLOBAL_BATCH, STEPS, LR = 8, 4, 1e-3
OPTIMIZER = dict(lr=LR)
# The stated tolerance against the fp32 run. Losses near 4.1 are bf16 numbers whose spacing is 1/32,
# and the ranks' losses round differently from the whole batch's: 3 spacings. Parameters: Adam moves
# every element by about lr per step whatever its gradient's size, so an element whose gradient is
# near zero may step the other way: the largest difference is bounded only by 2·lr·STEPS; the typical
# element must agree far better (an element moves about STEPS·lr = 4e-3 in all, so a wrong update
# shows): mean |difference| below 1e-4.
LOSS_ATOL, PARAM_MAX, PARAM_MEAN = 3 / 32, 2 * LR * STEPS, 1e-4


def batch(rank, world, step=0):
    return SyntheticCorpus().batch(step, GLOBAL_BATCH, rank=rank, world_size=world)


def training(steps, **extra):
    return model_labs.training(steps, GLOBAL_BATCH, OPTIMIZER, **extra)


def fp32_model(seed):
    torch.manual_seed(seed)
    return tiny_gpt()


WORLD = 2
PARAMETERS = model_labs.parameters()
UNITS = model_labs.fsdp_units(WORLD)
COMM = Fields({"name": str, "args": Fields({"group": [int], "dtype": str, "bytes_sent": int}, extra=True)}, extra=True)


def flat_of(unit, tensors: dict, dtype=FP32):
    flat = FlatBuffer(unit["shapes"], WORLD, dtype=dtype)
    flat.copy_from([tensors[name].to(dtype) for name in unit["param_names"]])
    return flat


@check(
    "unshard: the gathered unit is the bf16 rounding of the fp32 masters, and it travelled in bf16",
    points=2,
    world_sizes=(WORLD,),
    inputs=training(0),
    returns={
        "units": {u["name"]: {"gathered": [COMM], "flat": Tensor((u["padded"],), BF16), "master": str} for u in UNITS}
    },
)
def gathered_in_bf16(ctx, given, got):
    values = {name: p.detach() for name, p in fp32_model(given[0]["seed"]).named_parameters()}
    for r in range(ctx.world_size):
        for spec in UNITS:
            name, unit = spec["name"], got[r]["units"][spec["name"]]
            ctx.over_everyone(unit["gathered"], f"unshard() of unit {name!r}", r)
            gathered = [e["args"]["dtype"] for e in unit["gathered"] if e["name"] == "all_gather"]
            if gathered != ["bfloat16"]:
                ctx.fail(
                    f"rank {r}: unshard() of unit {name!r} all-gathered {gathered or 'nothing'}, "
                    "expected one all-gather in bfloat16: cast the fp32 master slice to param_dtype *before* "
                    "the all-gather, which is where mixed precision halves the bytes (an fp32 gather moves 4 "
                    "bytes per element, then rounds)"
                )
            ctx.expect(
                unit["flat"], flat_of(spec, values, BF16).data, f"unit {name!r}'s gathered flat parameter", rank=r
            )
            if unit["master"] != "torch.float32":
                ctx.fail(f"rank {r}: unit {name!r}'s master slice is {unit['master']}: it must stay fp32")


PRECISIONS = [("bfloat16", None), ("bfloat16", "float32")]


def _precisions(n, g):
    made = training(1)(n, g)
    return {
        f"MixedPrecision({param}, reduce_dtype={reduce})": [dict(mine, precision=(param, reduce)) for mine in made]
        for param, reduce in PRECISIONS
    }


@check(
    "gradients are reduced in reduce_dtype: bf16 by default, fp32 with MixedPrecision(reduce_dtype=fp32)",
    points=2,
    world_sizes=(WORLD,),
    cases=_precisions,
    returns={"dtypes": [COMM]},
)
def reduced_in_reduce_dtype(ctx, given, got):
    param, reduce = given[0]["precision"]
    expected = reduce or param
    for r in range(ctx.world_size):
        ctx.over_everyone(got[r]["dtypes"], "one backward", r)
        dtypes = sorted({e["args"]["dtype"] for e in got[r]["dtypes"] if e["name"] == "reduce_scatter"})
        if dtypes != [expected]:
            ctx.fail(
                f"rank {r}: with MixedPrecision({param}, reduce_dtype={reduce}) the gradients' "
                f"reduce-scatters ran in {dtypes or 'nothing'}, expected {expected}: make the flat gradient "
                "buffer in reduce_dtype (add_grad), and reduce-scatter that buffer"
            )


@check(
    "add_grad: the unit's gradients gathered in a reduce_dtype buffer, complete exactly at its last parameter's",
    points=1,
    world_sizes=(WORLD,),
    inputs=training(0),
    returns={"complete": List(bool, len(UNITS[1]["param_names"])), "buffer": str},
)
def add_grad_completes(ctx, given, got):
    count = len(UNITS[1]["param_names"])
    expected = [False] * (count - 1) + [True]
    for r in range(ctx.world_size):
        if got[r]["complete"] != expected:
            ctx.fail(
                f"rank {r}: add_grad on unit {UNITS[1]['name']!r}'s {count} parameters, one after the other, "
                f"answered {got[r]['complete']}; expected False until the last, then True: FSDP reduce-scatters a "
                "unit as soon as its last gradient has arrived (count them down from self.waiting), or the "
                "reduction waits for the end of backward and nothing overlaps"
            )
        if got[r]["buffer"] != "bfloat16":
            ctx.fail(
                f"rank {r}: add_grad gathered the gradients in a {got[r]['buffer']} buffer; with "
                "MixedPrecision(bfloat16) the reduce dtype is bfloat16: make the buffer in reduce_dtype"
            )


def _accumulating(n, g):
    made = training(2)(n, g)
    return {
        f"reduce_dtype={reduce}": [dict(mine, precision=("bfloat16", reduce)) for mine in made]
        for reduce in ("float32", None)
    }


@check(
    "the optimizer sees fp32: masters and gradient slices fp32, micro-batches accumulated in fp32",
    points=1,
    world_sizes=(WORLD,),
    cases=_accumulating,
    returns={"grads": {u["name"]: Maybe(Tensor((u["shard"],))) for u in UNITS}},
)
def fp32_for_the_optimizer(ctx, given, got):
    reference = fp32_model(given[0]["seed"])
    for step in range(2):  # two micro-batches, one step
        reference(*batch(0, 1, step)).backward()
    grads = {name: p.grad for name, p in reference.named_parameters()}
    for r in range(ctx.world_size):
        for unit in UNITS:
            mine = got[r]["grads"][unit["name"]]
            if mine is None or mine.dtype != FP32:
                ctx.fail(
                    f"rank {r}: unit {unit['name']!r}'s gradient slice is "
                    f"{'missing' if mine is None else getattr(mine, 'dtype', type(mine).__name__)}; finish_reduce "
                    "must leave an fp32 slice in self.mine.grad (the optimizer steps fp32 masters)"
                )
            expected = flat_of(unit, grads).shard(r)
            scale = expected.abs().max().item()
            worst = (mine - expected).abs().max().item()
            if worst > 0.05 * scale:  # bf16 compute (and reduction): about 1% per gradient; a lost micro-batch ~50%
                ctx.fail(
                    f"rank {r}: after two backwards unit {unit['name']!r}'s gradient slice differs from the fp32 "
                    f"sum of both micro-batches' gradients by up to {worst:.3g} (largest gradient {scale:.3g}): "
                    "add each backward's reduced slice into self.mine.grad instead of replacing it"
                )


@check(
    f"{STEPS} AdamW steps stay within the stated tolerance of the fp32 run (losses and parameters)",
    points=2,
    world_sizes=(WORLD,),
    inputs=training(STEPS),
    returns={"losses": List(float, STEPS), "params": {name: Tensor(tuple(p.shape)) for name, p in PARAMETERS.items()}},
)
def close_to_fp32(ctx, given, got):
    reference = fp32_model(given[0]["seed"])
    opt = torch.optim.AdamW(reference.parameters(), **OPTIMIZER)
    fp32_losses = []
    for step in range(STEPS):
        loss = reference(*batch(0, 1, step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        fp32_losses.append(loss.item())
    for r in range(ctx.world_size):
        for step, fp32 in enumerate(fp32_losses):
            mine = got[r]["losses"][step]
            if abs(mine - fp32) > LOSS_ATOL:
                ctx.fail(
                    f"rank {r}: step {step}'s loss is {mine:.4f} against the fp32 run's {fp32:.4f}; bf16 "
                    f"allows {LOSS_ATOL:.3f} (3 of bf16's spacings near 4)"
                )
        params = got[r]["params"]
        if any(params[n].dtype != FP32 for n, _ in reference.named_parameters()):
            ctx.fail(f"rank {r}: the trained parameters are not fp32: the masters must stay fp32")
        diffs = torch.cat([(params[n] - p.detach()).abs().flatten() for n, p in reference.named_parameters()])
        if diffs.max() > PARAM_MAX or diffs.mean() > PARAM_MEAN:
            ctx.fail(
                f"rank {r}: after {STEPS} steps the parameters differ from the fp32 run's by {diffs.mean():.2e} "
                f"on average (tolerance {PARAM_MEAN:.0e}) and {diffs.max():.2e} at most (tolerance "
                f"{PARAM_MAX:.0e}): are the masters fp32, and the reduced gradients cast to fp32?"
            )


@check(
    "bytes halved: a bf16 step moves half the bytes of the fp32 step, 3Ψ(N-1)/N x 2",
    points=1,
    world_sizes=(WORLD,),
    inputs=training(1),
    returns={"comms": [COMM]},
)
def bytes_halved(ctx, given, got):
    n = ctx.world_size
    psi = sum(u["padded"] for u in UNITS)
    for r in range(n):
        events = got[r]["comms"]
        sent = sum(e["args"]["bytes_sent"] for e in events)
        fp32 = 3 * psi * 4 * (n - 1) // n
        if abs(sent - fp32 / 2) > len(events):
            ctx.fail(
                f"rank {r}: a bf16 step sent {sent} bytes; the fp32 step sends 3Ψ(N-1)/N x 4 = {fp32} "
                f"(Ψ = {psi} padded elements), so bf16 should send {fp32 // 2}"
            )
