"""What every rank runs for lab 05's checks, next to your code: your four functions on the cases the grader
sent, and `toolkit.moe.MoE(shadow=your_choice)` on this rank's tokens (outputs, gradients, times on an
emulated link). The grader's process judges what these return (checks.py)."""

import statistics
import time

import torch
import torch.distributed as dist

import toolkit
from toolkit.moe import MoE
from toolkit.moe.experts import WEIGHTS

D, FF, SEED, INIT = 8, 16, 7, 0.3
GAIN = dict(d=16, ff=32, tokens=512, bandwidth=1e6, latency=1e-3, P=1e9, repeats=3)


def skew_router(layer):
    """Every token ranks the experts alike (feature 0 is set to 1): expert 0 first, then 1, both on rank 0."""
    E = layer.num_experts
    with torch.no_grad():
        scores = -0.1 * torch.arange(1, E + 1, dtype=torch.float32)
        scores[0], scores[1] = 2.0, 1.0
        layer.gate.router.weight.zero_()
        layer.gate.router.weight[:, 0] = scores
    return layer


def pure(student, rank, given):
    """Every call the case names, through the function it names: {its name: what it returned}."""
    return {
        name: getattr(student, call["fn"])(*call["args"], **call["kwargs"]) for name, call in given["calls"].items()
    }


def real_counts(student, rank, given):
    return {"choice": student.choose_shadows(given["table"], given["owners"], **given["model"])}


def equal_outputs(student, rank, given):
    chosen = student.choose_shadows(given["table"], given["owners"], **given["model"])
    found = {"chosen": chosen}
    if isinstance(chosen, list) and all(isinstance(e, int) and not isinstance(e, bool) for e in chosen):
        layer = MoE(D, FF, given["E"], group=rank.group, shadow=chosen, **given["options"])
        if given["skew"]:
            skew_router(layer)
        x = given["x"].clone().requires_grad_(True)
        out, aux = layer(x)
        ((out * given["probe"]).sum() + aux).backward()
        found.update(out=out.detach(), x_grad=x.grad, grads={w: getattr(layer.experts, w).grad for w in WEIGHTS})
    return found


def _timed(layer, x) -> float:
    dist.barrier()
    start = time.perf_counter()
    out, aux = layer(x)
    (out.square().mean() + 0.01 * aux).backward()
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # raw: bookkeeping, not on the emulated link
    return seconds.item()


def measured_gain(student, rank, given):
    g, E = GAIN, given["E"]
    options = dict(top_k=2, capacity_factor=4.0, seed=SEED, init_std=INIT)  # room for every choice: no drops
    chosen = student.choose_shadows(given["table"], given["owners"], **given["model"])
    if not (isinstance(chosen, list) and all(isinstance(e, int) and not isinstance(e, bool) for e in chosen)):
        return {"chosen": chosen}
    plain = skew_router(MoE(g["d"], g["ff"], E, group=rank.group, name="plain", **options))
    shadowed = skew_router(MoE(g["d"], g["ff"], E, group=rank.group, name="shadowed", shadow=chosen, **options))
    x = given["x"].clone().requires_grad_(True)  # as inside a model: the rows' gradients travel back too
    times = {"plain": [], "shadowed": []}
    with toolkit.comm.emulate(bandwidth=g["bandwidth"], latency=g["latency"]):
        for i in range(1 + g["repeats"]):
            for name, layer in (("plain", plain), ("shadowed", shadowed))[:: 1 if i % 2 else -1]:
                layer.zero_grad(set_to_none=True)
                x.grad = None
                seconds = _timed(layer, x)
                if i:
                    times[name].append(seconds)
    return {
        "chosen": chosen,
        "plain_s": statistics.median(times["plain"]),
        "shadowed_s": statistics.median(times["shadowed"]),
    }
