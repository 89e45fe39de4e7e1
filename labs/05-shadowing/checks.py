"""The graded checks of lab 05 (expert shadowing). Each runs on every rank of a real 2-rank job.

The pure functions are checked on hand-computed cases (the same ones tests/test_moe_shadow.py proves
the toolkit's predictor on); then the rule meets real ranks: its choice on the counts of a real MoE
layer must be Algorithm 1's and the same on every rank, the layer that shadows what it chose must
compute exactly what the plain layer computes, and on an emulated slow link it must be faster.
"""
import math
import statistics
import time
import zlib

import torch
import torch.distributed as dist

import toolkit
from toolkit.grading import check
from toolkit.moe import MoE, reference_moe
from toolkit.moe.experts import WEIGHTS
from toolkit.moe.shadow import choose_shadows as reference_choice

# Unit choices for the hand cases: H = 1, s = 1 byte, P = 12 FLOP/s, W_net = 4 B/s. Per row: compute
# 3*4*alpha/12 = alpha s, wire 4/4 = 1 s; per shadowed expert 2 * 2*alpha/4 = alpha s (both transfers).
UNITS = dict(H=1, P=12, W_net=4, element_bytes=1)
REALISTIC = dict(H=1024, alpha=4, P=1e13, W_net=1e10, element_bytes=4)

# name -> (counts, owners, model, shadowed set to check, expected loads, Lat_imbl, Lat_shadow, expected choice)
CASES = {
    "2 workers, one hot expert (alpha 1)":
        ([[6, 1], [6, 1]], [0, 1], dict(UNITS, alpha=1), [0], [6, 8], 24, 9, [0]),
    "2 workers, balanced, big experts (alpha 2)":
        ([[3, 3], [3, 3]], [0, 1], dict(UNITS, alpha=2), [0], [3, 9], 18, 20, []),
    "4 workers, two hot experts (alpha 1)":
        ([[8, 4, 1, 1]] * 4, [0, 1, 2, 3], dict(UNITS, alpha=1), [0, 1], [12, 12, 16, 16], 64, 18, [0, 1]),
    "2 workers, 2 experts each (alpha 1)":
        ([[5, 5, 1, 0], [5, 5, 0, 1]], [0, 0, 1, 1], dict(UNITS, alpha=1), [0, 1], [10, 12], 40, 14, [0, 1]),
    "fast link, symmetric skew: the greedy stops at once (alpha 1)":
        ([[6, 6], [6, 6]], [0, 1], dict(UNITS, alpha=1, W_net=400), [0, 1], [12, 12], 12.12, 12.02, []),
    "H = 1024, fp32, 10 TFLOP/s, 10 GB/s":
        ([[4000, 1000], [4000, 1000]], [0, 1], REALISTIC, [0], [4000, 6000], 0.053373, 0.036910, [0]),
    "the same on a link 100x slower, 10x fewer rows: moving weights costs more than the layer":
        ([[400, 100], [400, 100]], [0, 1], dict(REALISTIC, W_net=1e8), [0], [400, 600], 0.13510, 0.67411, []),
}

D, FF, SEED, INIT = 8, 16, 7, 0.3


def generator(*keys) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32("/".join(map(str, keys)).encode()))


def close(got, want) -> bool:
    try:
        return math.isclose(float(got), float(want), rel_tol=1e-4, abs_tol=1e-9)
    except (TypeError, ValueError):
        return False


def as_ids(choice, what, ctx, num_experts) -> list:
    """The student's choice as a list of expert ids, or a clear failure."""
    if not isinstance(choice, (list, tuple)) or not all(isinstance(e, int) and not isinstance(e, bool)
                                                        for e in choice):
        ctx.fail(f"{what}: choose_shadows must return a list of expert ids (ints), got {choice!r}")
    if any(not 0 <= e < num_experts for e in choice) or len(set(choice)) != len(choice):
        ctx.fail(f"{what}: choose_shadows returned {list(choice)}: each expert at most once, ids 0..{num_experts - 1}")
    return list(choice)


def explain(counts, owners, model) -> str:
    """Algorithm 1's steps on this case, from the toolkit's predictor, for the failure message."""
    return "Algorithm 1 on this case:\n  " + reference_choice(counts, owners, **model).explain().replace("\n", "\n  ")


# --- the pure functions --------------------------------------------------------------------------------
@check("worker_loads: B'_w, each expert's rows computed by its owner unless shadowed", points=1, world_sizes=(2,))
def loads(student, ctx):
    for counts, owners, _, shadowed, want, *_rest in CASES.values():
        got = student.worker_loads(counts, owners)
        want_plain = [sum(c for row in counts for e, c in enumerate(row) if owners[e] == w) for w in range(len(counts))]
        if not isinstance(got, (list, tuple)) or len(got) != len(counts) or not all(map(close, got, want_plain)):
            ctx.fail(f"worker_loads({counts}, owners {owners}) with nothing shadowed: got {got!r}, expected "
                     f"{want_plain} (every expert's rows go to its owner)")
        got = student.worker_loads(counts, owners, shadowed)
        if not isinstance(got, (list, tuple)) or len(got) != len(counts) or not all(map(close, got, want)):
            ctx.fail(f"worker_loads({counts}, owners {owners}, shadowed {shadowed}): got {got!r}, expected {want} "
                     f"(a shadowed expert's rows stay with the worker that routed them)")


@check("the latency model: Lat_imbl and Lat_shadow on hand-computed cases", points=2, world_sizes=(2,))
def model(student, ctx):
    for name, (counts, owners, units, shadowed, _, imbl, shadow, _) in CASES.items():
        got = student.latency_imbalanced(counts, owners, **units)
        if not close(got, imbl):
            ctx.fail(f"{name}: latency_imbalanced({counts}, owners {owners}, {units}) = {got!r}, expected {imbl} "
                     f"(max over workers of B_w * (3*4*alpha*H^2/P + 4*H*s/W_net))")
        got = student.latency_shadowed(counts, owners, shadowed, **units)
        if not close(got, shadow):
            ctx.fail(f"{name}: latency_shadowed(..., shadowed {shadowed}) = {got!r}, expected {shadow} "
                     f"(max over workers of B'_w * 3*4*alpha*H^2/P, plus 2r * 2*alpha*H^2*s/W_net)")
    counts, owners, units = CASES["2 workers, one hot expert (alpha 1)"][:3]
    got = student.latency_shadowed(counts, owners, [0, 0], **units)
    if not close(got, 9):
        ctx.fail(f"latency_shadowed with shadowed [0, 0] = {got!r}, expected 9, as for [0]: r counts distinct "
                 f"experts (one expert's weights travel once)")


@check("choose_shadows: Algorithm 1 picks the expected experts, in order, on hand-computed cases", points=3,
       world_sizes=(2,))
def algorithm(student, ctx):
    for name, (counts, owners, units, *_rest, want) in CASES.items():
        got = student.choose_shadows(counts, owners, **units)
        if got != want:
            ctx.fail(f"{name}: choose_shadows({counts}, owners {owners}) = {got!r}, expected {want}.\n"
                     + explain(counts, owners, units))


# --- on real ranks -------------------------------------------------------------------------------------
def skew_router(layer):
    """Every token ranks the experts alike (feature 0 is set to 1): expert 0 first, then 1, both on rank 0."""
    E = layer.num_experts
    with torch.no_grad():
        scores = -0.1 * torch.arange(1, E + 1, dtype=torch.float32)
        scores[0], scores[1] = 2.0, 1.0
        layer.gate.router.weight.zero_()
        layer.gate.router.weight[:, 0] = scores
    return layer


def tokens_of(tag, world, rank, count, d, skew):
    g = generator(tag, world, rank)
    x = torch.randn(count, d, generator=g)
    if skew:
        x[:, 0] = 1.0
    return x, torch.randn(x.shape, generator=g)


def counts_table(layer, inputs) -> list:
    """counts[w][e]: rows rank w routes to expert e after capacity, as the layer's own all-gather would
    give them. Every rank rebuilds every rank's tokens, so every rank computes the same table."""
    with torch.no_grad():
        return [layer.gate(x).kept_counts.tolist() for x, _ in inputs]


CONFIGS = {  # the rates the rule is given: slow compute and a fast link, so shadowing the hot experts pays
    "skewed routing": dict(skew=True, rates=dict(P=1e6, W_net=1e12)),
    "balanced routing": dict(skew=False, rates=dict(P=1e6, W_net=1e12)),
    "skewed routing, slow link": dict(skew=True, rates=dict(P=1e12, W_net=1e6)),
}


@check("on a real layer's counts: the same choice as Algorithm 1, on every rank", points=1, world_sizes=(2,))
def real_counts(student, ctx):
    n, E = ctx.world_size, 2 * ctx.world_size
    owners = [e // 2 for e in range(E)]
    for name, cfg in CONFIGS.items():
        layer = MoE(D, FF, E, top_k=2, capacity_factor=1.0, seed=SEED, init_std=INIT, group=ctx.group)
        if cfg["skew"]:
            skew_router(layer)
        inputs = [tokens_of(name, n, r, 12 + 4 * r, D, cfg["skew"]) for r in range(n)]
        table = counts_table(layer, inputs)
        model = dict(H=D, alpha=FF / D, element_bytes=4, **cfg["rates"])
        got = as_ids(student.choose_shadows(table, owners, **model), name, ctx, E)
        want = reference_choice(table, owners, **model).shadowed
        if got != want:
            ctx.fail(f"{name}: counts {table} (rows per rank per expert), owners {owners}, P = "
                     f"{model['P']:g} FLOP/s, W_net = {model['W_net']:g} B/s: you chose {got}, Algorithm 1 "
                     f"chooses {want}.\n" + explain(table, owners, model))
        everyone = [None] * n
        dist.all_gather_object(everyone, got, group=ctx.group)
        if any(choice != got for choice in everyone):
            ctx.fail(f"{name}: the ranks chose differently ({everyone}) from the same counts: the rule must be a "
                     f"pure function of its inputs, or the ranks' collectives stop matching and the job hangs")


def alone(ctx):
    """A process group holding only this rank: an MoE built on it holds every expert (the reference)."""
    mine, _ = dist.new_subgroups_by_enumeration([[r] for r in range(ctx.world_size)])
    return mine


@check("the layer that shadows your choice computes what the plain layer computes (outputs and gradients)",
       points=2, world_sizes=(2,))
def equal_outputs(student, ctx):
    n, r, E = ctx.world_size, ctx.rank, 2 * ctx.world_size
    owners, solo = [e // 2 for e in range(E)], alone(ctx)
    for name, cfg in CONFIGS.items():
        options = dict(top_k=2, capacity_factor=1.0, seed=SEED, init_std=INIT)
        probe_layer = MoE(D, FF, E, group=ctx.group, **options)
        reference = MoE(D, FF, E, group=solo, **options)
        if cfg["skew"]:
            skew_router(probe_layer), skew_router(reference)
        inputs = [tokens_of(name, n, rank, 12 + 4 * rank, D, cfg["skew"]) for rank in range(n)]
        model = dict(H=D, alpha=FF / D, element_bytes=4, **cfg["rates"])
        chosen = as_ids(student.choose_shadows(counts_table(probe_layer, inputs), owners, **model), name, ctx, E)
        layer = MoE(D, FF, E, group=ctx.group, shadow=chosen, **options)
        if cfg["skew"]:
            skew_router(layer)
        xs = [x.clone().requires_grad_(True) for x, _ in inputs]
        outs, auxes = reference_moe(reference, xs)
        sum((o * p).sum() + a for o, (_, p), a in zip(outs, inputs, auxes)).backward()
        x, probe = inputs[r][0].clone().requires_grad_(True), inputs[r][1]
        out, aux = layer(x)
        ((out * probe).sum() + aux).backward()
        what = f"{name}, shadowing your choice {chosen}"
        ctx.expect(out.detach(), outs[r].detach(), f"{what}: layer output", exact=False)
        ctx.expect(x.grad, xs[r].grad, f"{what}: gradient of the layer's input", exact=False)
        first = layer.experts.first
        for w in WEIGHTS:
            want = getattr(reference.experts, w).grad[first:first + layer.num_local]
            ctx.expect(getattr(layer.experts, w).grad, want, f"{what}: gradient of expert weight {w} on its owner",
                       exact=False)


# --- a measured gain -------------------------------------------------------------------------------------
GAIN = dict(d=16, ff=32, tokens=512, bandwidth=1e6, latency=1e-3, P=1e9, repeats=3, below=0.8)


def _timed(layer, x) -> float:
    dist.barrier()
    start = time.perf_counter()
    out, aux = layer(x)
    (out.square().mean() + 0.01 * aux).backward()
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # raw: bookkeeping, not on the emulated link
    return seconds.item()


@check("a measured gain: on an emulated 1 MB/s link, under strong skew, shadowing your choice is faster than the "
       "plain layer (time ratio below 0.8)", points=2, world_sizes=(2,))
def measured_gain(student, ctx):
    g, n, E = GAIN, ctx.world_size, 2 * ctx.world_size
    owners = [e // 2 for e in range(E)]
    options = dict(top_k=2, capacity_factor=4.0, seed=SEED, init_std=INIT)  # room for every choice: no drops
    plain = skew_router(MoE(g["d"], g["ff"], E, group=ctx.group, name="plain", **options))
    inputs = [tokens_of("gain", n, r, g["tokens"], g["d"], True) for r in range(n)]
    model = dict(H=g["d"], alpha=g["ff"] / g["d"], P=g["P"], W_net=g["bandwidth"], element_bytes=4)
    chosen = as_ids(student.choose_shadows(counts_table(plain, inputs), owners, **model), "gain", ctx, E)
    shadowed = skew_router(MoE(g["d"], g["ff"], E, group=ctx.group, name="shadowed", shadow=chosen, **options))
    x = inputs[ctx.rank][0].requires_grad_(True)  # as inside a model: the rows' gradients travel back too
    times = {"plain": [], "shadowed": []}
    with toolkit.comm.emulate(bandwidth=g["bandwidth"], latency=g["latency"]):
        for i in range(1 + g["repeats"]):
            for name, layer in (("plain", plain), ("shadowed", shadowed))[::1 if i % 2 else -1]:
                layer.zero_grad(set_to_none=True)
                x.grad = None
                seconds = _timed(layer, x)
                if i:
                    times[name].append(seconds)
    ratio = statistics.median(times["shadowed"]) / statistics.median(times["plain"])
    if ratio >= g["below"]:
        prediction = reference_choice(counts_table(plain, inputs), owners, **model)
        ctx.fail(f"shadowing {chosen} took {ratio:.2f} of the plain layer's time (median of {g['repeats']}: "
                 f"{statistics.median(times['shadowed']) * 1e3:.0f} ms vs {statistics.median(times['plain']) * 1e3:.0f} "
                 f"ms); below {g['below']} expected. Every token picks experts 0 and 1 (both on rank 0); with P = "
                 f"{g['P']:g} FLOP/s and W_net = {g['bandwidth']:g} B/s Algorithm 1 shadows {prediction.shadowed} "
                 f"(predicted {prediction.predicted_s * 1e3:.0f} ms vs {prediction.plain_s * 1e3:.0f} ms plain).")
