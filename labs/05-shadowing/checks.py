"""The graded checks of lab 05 (expert shadowing), judged in the grader's process.

The pure functions are checked on hand-computed cases (numbers worked out in README.md's units); then the
rule meets real ranks: its choice on the counts of a real MoE layer must be the same on every rank, the
layer that shadows what it chose must compute exactly what the plain layer computes, and on an emulated
slow link it must be faster. (Whether a real layer's choice is Algorithm 1's is a check graded on the
course platform.)
"""
import math

import torch

from toolkit.grading import check, number, sibling
from toolkit.moe import MoE, reference_moe
from toolkit.moe.experts import WEIGHTS

ANSWERS = {"toolkit.moe.shadow:worker_loads": "the toolkit's own loads",
           "toolkit.moe.shadow:latency_imbalanced": "the toolkit's own latency model",
           "toolkit.moe.shadow:latency_shadowed": "the toolkit's own latency model",
           "toolkit.moe.shadow:choose_shadows": "the toolkit's own Algorithm 1",
           "toolkit.moe.shadow:predict": "the toolkit's own predictor"}
BUILDS_ON = ["toolkit.moe.layer:MoE.forward", "toolkit.moe.layer:MoE.exchange_counts",  # the MoE layer (lab 04)
             "toolkit.moe.layer:MoE.sort_by_destination", "toolkit.moe.layer:MoE.dispatch_compute_combine",
             "toolkit.moe.layer:MoE.compute_experts", "toolkit.moe.layer:MoE.weighted_sum",
             "toolkit.moe.layer:all_to_all",
             # MoE(shadow=[...]) records what the predictor says of the forced choice (toolkit.moe.shadow's
             # Shadowing.decide), and the emulated link prices messages with the alpha-beta model (lab 10's)
             "toolkit.moe.shadow:predict", "toolkit.moe.shadow:worker_loads", "toolkit.moe.shadow:latency_imbalanced",
             "toolkit.moe.shadow:latency_shadowed", "toolkit.memory.formulas:alpha_beta_time"]
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
GAIN_BELOW = 0.8


def close(got, want) -> bool:
    try:
        return math.isclose(float(got), float(want), rel_tol=1e-4, abs_tol=1e-9)
    except (TypeError, ValueError):
        return False


def as_ids(ctx, choice, what, num_experts) -> list:
    """The student's choice as a list of expert ids, or a clear failure."""
    if not isinstance(choice, list) or not all(isinstance(e, int) and not isinstance(e, bool) for e in choice):
        ctx.fail(f"{what}: choose_shadows must return a list of expert ids (ints), got {number(choice)}")
    if any(not 0 <= e < num_experts for e in choice) or len(set(choice)) != len(choice):
        ctx.fail(f"{what}: choose_shadows returned {list(choice)}: each expert at most once, ids 0..{num_experts - 1}")
    return list(choice)


def calls(*entries):
    return {"calls": [{"fn": fn, "args": list(args), "kwargs": kwargs} for fn, args, kwargs in entries]}


# --- the pure functions --------------------------------------------------------------------------------
@check("worker_loads: B'_w, each expert's rows computed by its owner unless shadowed", points=1,
       world_sizes=(2,), pure=True, task="pure", inputs=calls(*[e for counts, owners, _, shadowed, *_ in CASES.values()
                                   for e in (("worker_loads", (counts, owners), {}),
                                             ("worker_loads", (counts, owners, shadowed), {}))]))
def loads(ctx, given, got):
    results = iter(got[0]["results"])
    for counts, owners, _, shadowed, want, *_rest in CASES.values():
        plain = [sum(c for row in counts for e, c in enumerate(row) if owners[e] == w) for w in range(len(counts))]
        for value, expected, with_what in ((next(results), plain, "with nothing shadowed"),
                                           (next(results), want, f"shadowed {shadowed}")):
            if not isinstance(value, list) or len(value) != len(counts) or not all(map(close, value, expected)):
                ctx.fail(f"worker_loads({counts}, owners {owners}) {with_what}: got {number(value)}, expected "
                         f"{expected} " + ("(every expert's rows go to its owner)" if expected is not want else
                                           "(a shadowed expert's rows stay with the worker that routed them)"))


@check("the latency model: Lat_imbl and Lat_shadow on hand-computed cases", points=2, world_sizes=(2,),
       pure=True, task="pure",
       inputs=calls(*[e for counts, owners, units, shadowed, *_ in CASES.values()
                      for e in (("latency_imbalanced", (counts, owners), units),
                                ("latency_shadowed", (counts, owners, shadowed), units))],
                    ("latency_shadowed", ([[6, 1], [6, 1]], [0, 1], [0, 0]), dict(UNITS, alpha=1))))
def model(ctx, given, got):
    results = iter(got[0]["results"])
    for name, (counts, owners, units, shadowed, _, imbl, shadow, _) in CASES.items():
        value = next(results)
        if not close(value, imbl):
            ctx.fail(f"{name}: latency_imbalanced({counts}, owners {owners}, {units}) = {number(value)}, expected "
                     f"{imbl} (max over workers of B_w * (3*4*alpha*H^2/P + 4*H*s/W_net))")
        value = next(results)
        if not close(value, shadow):
            ctx.fail(f"{name}: latency_shadowed(..., shadowed {shadowed}) = {number(value)}, expected {shadow} "
                     f"(max over workers of B'_w * 3*4*alpha*H^2/P, plus 2r * 2*alpha*H^2*s/W_net)")
    value = next(results)
    if not close(value, 9):
        ctx.fail(f"latency_shadowed with shadowed [0, 0] = {number(value)}, expected 9, as for [0]: r counts "
                 "distinct experts (one expert's weights travel once)")


@check("choose_shadows: Algorithm 1 picks the expected experts, in order, on hand-computed cases", points=3,
       world_sizes=(2,), pure=True, task="pure",
       inputs=calls(*[("choose_shadows", (counts, owners), units) for counts, owners, units, *_ in CASES.values()]))
def algorithm(ctx, given, got):
    for (name, (counts, owners, *_rest, want)), value in zip(CASES.items(), got[0]["results"]):
        if value != want:
            ctx.fail(f"{name}: choose_shadows({counts}, owners {owners}) = {number(value)}, expected {want} "
                     "(README, 'Algorithm 1': heaviest expert first; accept while the latency drops below the best "
                     "so far, stop at the first that does not)")


# --- on real ranks -------------------------------------------------------------------------------------
CONFIGS = {  # the rates the rule is given: slow compute and a fast link, so shadowing the hot experts pays
    "skewed routing": dict(skew=True, rates=dict(P=1e6, W_net=1e12)),
    "balanced routing": dict(skew=False, rates=dict(P=1e6, W_net=1e12)),
    "skewed routing, slow link": dict(skew=True, rates=dict(P=1e12, W_net=1e6)),
}


skew_router = sibling(__file__).skew_router  # every token ranks experts 0 and 1 first, both on rank 0


def table_of(layer, xs) -> list:
    """counts[w][e]: rows rank w routes to expert e after capacity, as the layer's own all-gather gives them."""
    with torch.no_grad():
        return [layer.gate(x).kept_counts.tolist() for x in xs]


def real_inputs(n, g, with_tokens=False):
    E, owners, options = 2 * n, [e // 2 for e in range(2 * n)], dict(top_k=2, capacity_factor=1.0, seed=SEED,
                                                                      init_std=INIT)
    per_rank = [{"cases": []} for _ in range(n)]
    for name, cfg in CONFIGS.items():
        xs = [torch.randn(12 + 4 * r, D, generator=g) for r in range(n)]
        probes = [torch.randn(x.shape, generator=g) for x in xs]
        for x in xs:
            if cfg["skew"]:
                x[:, 0] = 1.0
        layer = MoE(D, FF, E, **options)
        if cfg["skew"]:
            skew_router(layer)
        table = table_of(layer, xs)
        for r in range(n):
            case = {"name": name, "table": table, "owners": owners, "E": E, "options": options, "skew": cfg["skew"],
                    "model": dict(H=D, alpha=FF / D, element_bytes=4, **cfg["rates"])}
            if with_tokens:
                case.update(x=xs[r], probe=probes[r])
            per_rank[r]["cases"].append(case)
    return per_rank


@check("on a real layer's counts: a valid choice, the same on every rank", points=1, world_sizes=(2,),
       inputs=real_inputs)
def real_counts(ctx, given, got):
    for k, case in enumerate(given[0]["cases"]):
        everyone = [as_ids(ctx, got[r]["choices"][k], f"{case['name']}, rank {r}", case["E"])
                    for r in range(ctx.world_size)]
        if any(choice != everyone[0] for choice in everyone):
            ctx.fail(f"{case['name']}: the ranks chose differently ({everyone}) from the same counts: the rule must be "
                     f"a pure function of its inputs, or the ranks' collectives stop matching and the job hangs")


@check("the layer that shadows your choice computes what the plain layer computes (outputs and gradients)",
       points=2, world_sizes=(2,), inputs=lambda n, g: real_inputs(n, g, with_tokens=True))
def equal_outputs(ctx, given, got):
    n = ctx.world_size
    for k, case in enumerate(given[0]["cases"]):
        reference = MoE(D, FF, case["E"], **case["options"])
        if case["skew"]:
            skew_router(reference)
        xs = [given[r]["cases"][k]["x"].clone().requires_grad_(True) for r in range(n)]
        outs, auxes = reference_moe(reference, xs)
        sum((o * given[r]["cases"][k]["probe"]).sum() + a for r, (o, a) in enumerate(zip(outs, auxes))).backward()
        for r in range(n):
            found = got[r]["cases"][k]
            chosen = as_ids(ctx, found["chosen"], f"{case['name']}, rank {r}", case["E"])
            what = f"{case['name']}, shadowing your choice {chosen}"
            ctx.expect(found["out"], outs[r].detach(), f"{what}: layer output", rank=r, exact=False)
            ctx.expect(found["x_grad"], xs[r].grad, f"{what}: gradient of the layer's input", rank=r, exact=False)
            first, local = found["first"], found["local"]
            for w in WEIGHTS:
                want = getattr(reference.experts, w).grad[first:first + local]
                ctx.expect(found["grads"][w], want, f"{what}: gradient of expert weight {w} on its owner", rank=r,
                           exact=False)


def gain_inputs(n, g):
    d, ff, count = 16, 32, 512
    E, owners = 2 * n, [e // 2 for e in range(2 * n)]
    xs = [torch.randn(count, d, generator=g) for _ in range(n)]
    for x in xs:
        x[:, 0] = 1.0
    plain = skew_router(MoE(d, ff, E, top_k=2, capacity_factor=4.0, seed=SEED, init_std=INIT))
    model = dict(H=d, alpha=ff / d, P=1e9, W_net=1e6, element_bytes=4)
    return [{"E": E, "owners": owners, "table": table_of(plain, xs), "model": model, "x": xs[r]} for r in range(n)]


@check("a measured gain: on an emulated 1 MB/s link, under strong skew, shadowing your choice is faster than the "
       "plain layer (time ratio below 0.8)", points=2, world_sizes=(2,), inputs=gain_inputs)
def measured_gain(ctx, given, got):
    mine = got[0]
    chosen = as_ids(ctx, mine["chosen"], "gain", given[0]["E"])
    ratio = mine["shadowed_s"] / mine["plain_s"]
    if not ratio < GAIN_BELOW:
        ctx.fail(f"shadowing {chosen} took {ratio:.2f} of the plain layer's time (median of 3: "
                 f"{mine['shadowed_s'] * 1e3:.0f} ms vs {mine['plain_s'] * 1e3:.0f} ms); below {GAIN_BELOW} expected. "
                 f"Every token picks experts 0 and 1 (both on rank 0); with P = 1e9 FLOP/s and W_net = 1e6 B/s the "
                 "hot experts' rows cost far more to move than their weights")
