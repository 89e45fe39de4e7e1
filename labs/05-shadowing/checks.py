"""The graded checks of lab 05 (expert shadowing), judged in the grader's process.

The latency model and Algorithm 1 are the lab's answer, so nothing here computes them: the pure functions are
judged by what any right answer satisfies, on cases drawn for each grading (every row computed once, a shadowed
expert's rows kept where they were routed; latencies that grow with the rows and shrink with the rates, a
shadowed expert counted once, the rows' traffic left out of Lat_shadow; distinct experts, heaviest first, each
accepted one lowering your own model's latency). Then the rule meets real ranks: its choice on the counts of a
real MoE layer must be the same on every rank, the layer that shadows what it chose must compute exactly what
the plain layer computes, and on an emulated slow link it must be faster. The exact values, and whether a choice
is Algorithm 1's, are checks graded on the course platform (`hidden_checks.py`).
"""

import math
import random

import torch

from toolkit.grading import Either, List, Maybe, Tensor, check, like, number, sibling
from toolkit.moe import MoE, reference_moe
from toolkit.moe.experts import WEIGHTS

ANSWERS = {
    "toolkit.moe.shadow:worker_loads": "the toolkit's own loads",
    "toolkit.moe.shadow:latency_imbalanced": "the toolkit's own latency model",
    "toolkit.moe.shadow:latency_shadowed": "the toolkit's own latency model",
    "toolkit.moe.shadow:choose_shadows": "the toolkit's own Algorithm 1",
    "toolkit.moe.shadow:predict": "the toolkit's own predictor",
}
BUILDS_ON = [
    "toolkit.moe.layer:MoE.forward",
    "toolkit.moe.layer:MoE.exchange_counts",  # the MoE layer (lab 04)
    "toolkit.moe.layer:MoE.sort_by_destination",
    "toolkit.moe.layer:MoE.dispatch_compute_combine",
    "toolkit.moe.layer:MoE.compute_experts",
    "toolkit.moe.layer:MoE.weighted_sum",
    "toolkit.moe.exchange:all_to_all",
    "toolkit.moe.exchange:_AllToAll",
    "toolkit.moe.units:run_units",  # shadowing's rows kept home run beside the exchange as units (lab 09's)
    # MoE(shadow=[...]) records what the predictor says of the forced choice (toolkit.moe.shadow's
    # Shadowing.decide), and the emulated link prices messages with the alpha-beta model (lab 10's)
    "toolkit.moe.shadow:predict",
    "toolkit.moe.shadow:worker_loads",
    "toolkit.moe.shadow:latency_imbalanced",
    "toolkit.moe.shadow:latency_shadowed",
    "toolkit.memory.formulas:alpha_beta_time",
    "toolkit.memory.formulas:_steps_and_bytes",
    "toolkit.memory.formulas:bytes_on_wire",
    "toolkit.memory.formulas:ring_reduce_scatter_bytes",
    "toolkit.memory.formulas:ring_all_gather_bytes",
    "toolkit.memory.formulas:ring_all_reduce_bytes",
]
D, FF, SEED, INIT = 8, 16, 7, 0.3
GAIN_BELOW = 0.8
CHOICE = List(int, why="choose_shadows returns a list of expert ids (ints)")


def close(got, want) -> bool:
    try:
        return math.isclose(float(got), float(want), rel_tol=1e-9, abs_tol=1e-12)
    except (TypeError, ValueError):
        return False


def as_ids(ctx, choice, what, num_experts) -> list:
    """The student's choice (a list of ints, the contract saw to that), or a failure if an id is out of range or
    repeated."""
    if any(not 0 <= e < num_experts for e in choice) or len(set(choice)) != len(choice):
        ctx.fail(f"{what}: choose_shadows returned {list(choice)}: each expert at most once, ids 0..{num_experts - 1}")
    return list(choice)


# --- the pure functions, on cases drawn for each grading ---------------------------------------------------------
def draw_case(r: random.Random) -> dict:
    """W workers, E experts (some worker may own none), rows routed with one or two hot experts, a realistic model."""
    workers, experts = r.randint(2, 4), r.randint(2, 6)
    owners = [r.randrange(workers) for _ in range(experts)]
    hot = r.sample(range(experts), r.randint(1, 2))
    counts = [
        [r.randint(0, 50) + (r.randint(100, 400) if e in hot else 0) for e in range(experts)] for _ in range(workers)
    ]
    model = dict(
        H=r.choice([256, 1024, 4096]),
        alpha=r.choice([2, 4]),
        P=10 ** r.uniform(11, 14),
        W_net=10 ** r.uniform(8, 11),
        element_bytes=r.choice([2, 4]),
    )
    return {"counts": counts, "owners": owners, "model": model}


def calls_of(case) -> dict:
    """The calls the pure checks read, by name: the case, the rows doubled, the rates doubled, a set listed twice."""
    counts, owners, model = case["counts"], case["owners"], case["model"]
    experts = len(owners)
    some = sorted({0, experts - 1})
    doubled = [[2 * c for c in row] for row in counts]
    faster = dict(model, P=2 * model["P"], W_net=2 * model["W_net"])
    found = {
        "loads": ("worker_loads", [counts, owners], {}),
        "loads, all shadowed": ("worker_loads", [counts, owners, list(range(experts))], {}),
        "loads, some shadowed": ("worker_loads", [counts, owners, some], {}),
        "imbalanced": ("latency_imbalanced", [counts, owners], model),
        "imbalanced, rows doubled": ("latency_imbalanced", [doubled, owners], model),
        "imbalanced, rates doubled": ("latency_imbalanced", [counts, owners], faster),
        "shadowed, none": ("latency_shadowed", [counts, owners, []], model),
        "shadowed, none, rows free": ("latency_shadowed", [counts, owners, []], dict(model, W_net=1e30)),
        "shadowed, some": ("latency_shadowed", [counts, owners, some], model),
        "shadowed, some twice": ("latency_shadowed", [counts, owners, some + some], model),
        "choice": ("choose_shadows", [counts, owners], model),
    }
    load = [sum(row[e] for row in counts) for e in range(experts)]
    for k, e in enumerate(sorted(range(experts), key=lambda e: (-load[e], e))[:3]):
        order = sorted(range(experts), key=lambda e: (-load[e], e))
        found[f"shadowed, the {k + 1} heaviest"] = ("latency_shadowed", [counts, owners, order[: k + 1]], model)
    return {name: {"fn": fn, "args": args, "kwargs": kwargs} for name, (fn, args, kwargs) in found.items()}


# A tie: once experts 0 and 1 are shadowed, shadowing the idle expert 2 leaves every load as it is, and on a free
# link its weights cost nothing, so the latency stays exactly the best so far: not lower, so the search stops.
TIE = {
    "counts": [[10, 10, 0], [10, 10, 0]],
    "owners": [0, 0, 1],
    "model": dict(H=1, alpha=1, P=12, W_net=1e300, element_bytes=1),
}


def pure_cases(n, g):
    """Five cases drawn for this grading, and the tie."""
    r = random.Random(int(g.initial_seed()))
    cases = {}
    for k in range(5):
        case = draw_case(r)
        cases[
            f"{len(case['counts'])} workers, {len(case['owners'])} experts owned by {case['owners']} (drawn case "
            f"{k + 1})"
        ] = dict(case, calls=calls_of(case))
    cases["a tie: an idle expert on a free link"] = dict(TIE, calls=calls_of(TIE))
    return cases


def pure_returned(case, r, n):
    workers = len(case["counts"])
    return {
        name: List(float, workers, why="worker_loads returns one number per worker")
        if call["fn"] == "worker_loads"
        else CHOICE
        if call["fn"] == "choose_shadows"
        else float
        for name, call in case["calls"].items()
    }


@check(
    "worker_loads: every row computed exactly once, an expert's rows by its owner, a shadowed expert's rows by "
    "the worker that routed them",
    points=1,
    world_sizes=(2,),
    pure=True,
    task="pure",
    cases=pure_cases,
    returns=pure_returned,
)
def loads(ctx, given, got):
    counts, owners, mine = given[0]["counts"], given[0]["owners"], got[0]
    total, workers = sum(map(sum, counts)), len(counts)
    said = f"worker_loads(counts {counts}, owners {owners}"
    for name in ("loads", "loads, some shadowed", "loads, all shadowed"):
        if not close(sum(mine[name]), total):
            shadowed = given[0]["calls"][name]["args"][2:]
            ctx.fail(
                f"{said}{', shadowed ' + str(shadowed[0]) if shadowed else ''}) = {number(mine[name])}: "
                f"{number(sum(mine[name]))} rows in all, but {total} were routed: every row is computed once, "
                "by one worker"
            )
    idle = [w for w in range(workers) if w not in owners]
    if any(mine["loads"][w] != 0 for w in idle):
        ctx.fail(
            f"{said}) = {number(mine['loads'])}: worker(s) {idle} own no expert, so with nothing shadowed they "
            "compute nothing (every expert's rows, from every worker, go to its owner)"
        )
    own = [float(sum(row)) for row in counts]
    if not all(map(close, mine["loads, all shadowed"], own)):
        ctx.fail(
            f"{said}, every expert shadowed) = {number(mine['loads, all shadowed'])}, expected {own}: a shadowed "
            "expert's rows stay with the worker that routed them, so with every expert shadowed each worker "
            "computes exactly what it routed"
        )


@check(
    "the latency model: proportional to the rows, inversely to the rates; a shadowed expert counted once; "
    "the rows' traffic left out of Lat_shadow",
    points=1,
    world_sizes=(2,),
    pure=True,
    task="pure",
    cases=pure_cases,
    returns=pure_returned,
)
def model(ctx, given, got):
    counts, owners, mine = given[0]["counts"], given[0]["owners"], got[0]
    said = f"counts {counts}, owners {owners}"
    if not close(mine["imbalanced, rows doubled"], 2 * mine["imbalanced"]):
        ctx.fail(
            f"{said}: latency_imbalanced is {number(mine['imbalanced'])}, and "
            f"{number(mine['imbalanced, rows doubled'])} with every count doubled: each row costs the same compute "
            "and bytes, so twice the rows take twice the time"
        )
    if not close(mine["imbalanced, rates doubled"], mine["imbalanced"] / 2):
        ctx.fail(
            f"{said}: latency_imbalanced is {number(mine['imbalanced'])}, and "
            f"{number(mine['imbalanced, rates doubled'])} with P and W_net doubled: FLOPs / P plus bytes / W_net "
            "halves when both rates double"
        )
    if not close(mine["shadowed, some twice"], mine["shadowed, some"]):
        ctx.fail(
            f"{said}: latency_shadowed with an expert listed twice is {number(mine['shadowed, some twice'])}, "
            f"once {number(mine['shadowed, some'])}: r counts distinct experts (one expert's weights travel once)"
        )
    if not close(mine["shadowed, none"], mine["shadowed, none, rows free"]):
        ctx.fail(
            f"{said}: latency_shadowed with nothing shadowed depends on W_net ({number(mine['shadowed, none'])}, "
            f"{number(mine['shadowed, none, rows free'])} on a free link): as in the paper it counts the "
            "computation and the weights' traffic, not the rows that still travel"
        )
    finite_link = given[0]["model"]["W_net"] < 1e100  # on a free link the rows' traffic rounds away
    if finite_link and not mine["shadowed, none"] < mine["imbalanced"]:
        ctx.fail(
            f"{said}: latency_shadowed with nothing shadowed is {number(mine['shadowed, none'])}, not below "
            f"latency_imbalanced {number(mine['imbalanced'])}: the plain layer also pays for the rows' traffic"
        )


@check(
    "choose_shadows: distinct experts, tried heaviest first, each accepted one lowering your model's latency",
    points=1,
    world_sizes=(2,),
    pure=True,
    task="pure",
    cases=pure_cases,
    returns=pure_returned,
)
def algorithm(ctx, given, got):
    counts, owners, mine = given[0]["counts"], given[0]["owners"], got[0]
    experts = len(owners)
    chosen = as_ids(ctx, mine["choice"], f"counts {counts}, owners {owners}", experts)
    load = [sum(row[e] for row in counts) for e in range(experts)]
    order = sorted(range(experts), key=lambda e: (-load[e], e))
    if chosen != order[: len(chosen)]:
        ctx.fail(
            f"choose_shadows(counts {counts}, owners {owners}) = {chosen}: candidates are tried heaviest first "
            f"(loads {load}; ties: lower id first), so a choice is a start of {order}"
        )
    if not chosen and mine["shadowed, the 1 heaviest"] < mine["imbalanced"]:
        ctx.fail(
            f"choose_shadows(counts {counts}, owners {owners}) = []: yet your own model says shadowing the "
            f"heaviest expert, {order[0]}, lowers the latency from {number(mine['imbalanced'])} to "
            f"{number(mine['shadowed, the 1 heaviest'])}: the first candidate tried is the heaviest, and it is "
            "accepted when it pays"
        )
    latencies = [mine["imbalanced"]] + [mine[f"shadowed, the {k} heaviest"] for k in range(1, min(len(chosen), 3) + 1)]
    if any(not later < earlier for earlier, later in zip(latencies, latencies[1:])):
        ctx.fail(
            f"choose_shadows(counts {counts}, owners {owners}) = {chosen}, but your own model's latencies along it "
            f"are {[number(x) for x in latencies]}: an expert is accepted only when it lowers the latency below "
            "the best so far"
        )


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
    E, owners, options = (
        2 * n,
        [e // 2 for e in range(2 * n)],
        dict(top_k=2, capacity_factor=1.0, seed=SEED, init_std=INIT),
    )
    cases = {}
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
        case = {
            "table": table,
            "owners": owners,
            "E": E,
            "options": options,
            "skew": cfg["skew"],
            "model": dict(H=D, alpha=FF / D, element_bytes=4, **cfg["rates"]),
        }
        cases[name] = [dict(case, x=xs[r], probe=probes[r]) if with_tokens else dict(case) for r in range(n)]
    return cases


@check(
    "on a real layer's counts: a valid choice, the same on every rank",
    points=1,
    world_sizes=(2,),
    cases=real_inputs,
    returns={"choice": CHOICE},
)
def real_counts(ctx, given, got):
    case = given[0]
    everyone = [as_ids(ctx, got[r]["choice"], f"{ctx.case}, rank {r}", case["E"]) for r in range(ctx.world_size)]
    if any(choice != everyone[0] for choice in everyone):
        ctx.fail(
            f"{ctx.case}: the ranks chose differently ({everyone}) from the same counts: the rule must be "
            f"a pure function of its inputs, or the ranks' collectives stop matching and the job hangs"
        )


def shadowed_layer(case, r, n):
    """The choice, and (when it is a list of ints) the shadowed layer's output and gradients on this rank."""
    with torch.device("meta"):
        experts = MoE(D, FF, case["E"], **case["options"]).experts  # one rank's share: E / n experts of E
    local = case["E"] // n
    return Either(
        {
            "chosen": CHOICE,
            "out": like(case["x"]),
            "x_grad": Maybe(like(case["x"])),
            "grads": {w: Maybe(Tensor((local, *getattr(experts, w).shape[1:]), torch.float32)) for w in WEIGHTS},
        },
        {"chosen": CHOICE},
    )


@check(
    "the layer that shadows your choice computes what the plain layer computes (outputs and gradients)",
    points=2,
    world_sizes=(2,),
    cases=lambda n, g: real_inputs(n, g, with_tokens=True),
    returns=shadowed_layer,
)
def equal_outputs(ctx, given, got):
    n, case = ctx.world_size, given[0]
    reference = MoE(D, FF, case["E"], **case["options"])
    if case["skew"]:
        skew_router(reference)
    xs = [given[r]["x"].clone().requires_grad_(True) for r in range(n)]
    outs, auxes = reference_moe(reference, xs)
    sum((o * given[r]["probe"]).sum() + a for r, (o, a) in enumerate(zip(outs, auxes))).backward()
    for r in range(n):
        found = got[r]
        chosen = as_ids(ctx, found["chosen"], f"{ctx.case}, rank {r}", case["E"])
        what = f"{ctx.case}, shadowing your choice {chosen}"
        ctx.expect(found["out"], outs[r].detach(), f"{what}: layer output", rank=r, exact=False)
        ctx.expect(found["x_grad"], xs[r].grad, f"{what}: gradient of the layer's input", rank=r, exact=False)
        local = case["E"] // n  # the layer's experts per rank (given code): rank r's are r·local ...
        first = r * local
        for w in WEIGHTS:
            want = getattr(reference.experts, w).grad[first : first + local]
            ctx.expect(
                found["grads"][w], want, f"{what}: gradient of expert weight {w} on its owner", rank=r, exact=False
            )


def gain_inputs(n, g):
    d, ff, count = 16, 32, 512
    E, owners = 2 * n, [e // 2 for e in range(2 * n)]
    xs = [torch.randn(count, d, generator=g) for _ in range(n)]
    for x in xs:
        x[:, 0] = 1.0
    plain = skew_router(MoE(d, ff, E, top_k=2, capacity_factor=4.0, seed=SEED, init_std=INIT))
    model = dict(H=d, alpha=ff / d, P=1e9, W_net=1e6, element_bytes=4)
    return [{"E": E, "owners": owners, "table": table_of(plain, xs), "model": model, "x": xs[r]} for r in range(n)]


@check(
    "a measured gain: on an emulated 1 MB/s link, under strong skew, shadowing your choice is faster than the "
    "plain layer (time ratio below 0.8)",
    points=2,
    world_sizes=(2,),
    inputs=gain_inputs,
    returns=Either({"chosen": CHOICE, "plain_s": float, "shadowed_s": float}, {"chosen": CHOICE}),
)
def measured_gain(ctx, given, got):
    mine = got[0]
    chosen = as_ids(ctx, mine["chosen"], "gain", given[0]["E"])
    if "plain_s" not in mine:
        ctx.fail(f"choose_shadows returned {chosen}, and the layers were not timed")
    ratio = mine["shadowed_s"] / mine["plain_s"]
    if not ratio < GAIN_BELOW:
        ctx.fail(
            f"shadowing {chosen} took {ratio:.2f} of the plain layer's time (median of 3: "
            f"{mine['shadowed_s'] * 1e3:.0f} ms vs {mine['plain_s'] * 1e3:.0f} ms); below {GAIN_BELOW} expected. "
            f"Every token picks experts 0 and 1 (both on rank 0); with P = 1e9 FLOP/s and W_net = 1e6 B/s the "
            "hot experts' rows cost far more to move than their weights"
        )
