"""The graded checks of lab 04 (MoE dispatch and combine), judged in the grader's process.

The grader draws every rank's tokens, sends each rank its own, and computes the right answer here: the
pieces against small hand-computable cases, the whole layer against `toolkit.moe.reference_moe`, the
one-process brute force that holds every expert (same seed, hence the same weights as the experts spread
over the ranks).
"""

import torch

from toolkit.grading import Either, Fields, Maybe, Tensor, check, like, sibling
from toolkit.moe import MoE, reference_moe
from toolkit.moe.capacity import capacity
from toolkit.moe.experts import WEIGHTS, Experts

ANSWERS = {
    "toolkit.moe.layer:MoE.forward": "the toolkit's own MoE layer",
    "toolkit.moe.layer:MoE.exchange_counts": "the toolkit's own count exchange",
    "toolkit.moe.layer:MoE.sort_by_destination": "the toolkit's own dispatch order",
    "toolkit.moe.layer:MoE.dispatch_compute_combine": "the toolkit's own dispatch and combine",
    "toolkit.moe.layer:MoE.compute_experts": "the toolkit's own local experts",
    "toolkit.moe.layer:MoE.weighted_sum": "the toolkit's own combine",
    "toolkit.moe.exchange:all_to_all": "the toolkit's own differentiable all-to-all",
    "toolkit.moe.exchange:_AllToAll": "the toolkit's own differentiable all-to-all (its autograd function)",
    "torch.distributed.nn.functional": "PyTorch's differentiable collectives (an all-to-all among them)",
    "torch.distributed._functional_collectives:all_to_all_single_autograd": "PyTorch's differentiable all-to-all",
}
D, FF, SEED, INIT = 8, 16, 7, 0.3
ROLES = ["counts", "dispatch", "combine", "combine backward", "dispatch backward"]
COMM = Fields({"name": str, "args": Fields({"group": [int], "dtype": str}, extra=True)}, extra=True)


TASKS = sibling(__file__)  # the gate a case builds, the order combine receives: plain functions of the inputs


def tokens(n, g, skew=False):
    """Rank r's tokens, (2, 3 + 2r, D): every rank routes a different number; and a probe for the loss."""
    found = []
    for r in range(n):
        x = torch.randn(2, 3 + 2 * r, D, generator=g)
        if skew:
            x[..., 0] = 1.0
        found.append((x, torch.randn(x.shape, generator=g)))
    return found


# --- the pieces ----------------------------------------------------------------------------------------
def _counts_inputs(n, g):
    return {
        f"{p} expert(s) per rank": [
            {"kept": torch.randint(0, 9, (p * n,), generator=g), "per_rank": p} for _ in range(n)
        ]
        for p in (1, 2)
    }


def _counts_returned(case, r, n):
    table = Tensor((n, case["per_rank"]), torch.int64)
    return {"send": table, "recv": table}


@check(
    "exchange_counts: every rank learns how many rows it gets from each rank for each of its experts",
    points=2,
    world_sizes=(2, 4),
    cases=_counts_inputs,
    returns=_counts_returned,
)
def counts(ctx, given, got):
    n, per_rank = ctx.world_size, given[0]["per_rank"]
    everyone = [given[r]["kept"] for r in range(n)]
    for r in range(n):
        what = (
            f"exchange_counts with {per_rank * n} experts over {n} ranks (rank {r}'s kept counts "
            f"{everyone[r].tolist()})"
        )
        ctx.expect(got[r]["send"], everyone[r].reshape(n, per_rank), f"{what}: send", rank=r)
        expected = torch.stack([everyone[j].reshape(n, per_rank)[r] for j in range(n)])
        ctx.expect(got[r]["recv"], expected, f"{what}: recv (row j: what rank j sends to this rank's experts)", rank=r)


SORT_CASES = ((4, 2, 0.75), (6, 1, 0.5), (4, 2, 4.0))


def _sort_inputs(n, g):
    return {
        f"{E} experts, top-{k}, capacity factor {f}": [
            {
                "E": E,
                "k": k,
                "factor": f,
                "gate_seed": int(torch.randint(0, 2**31, (), generator=g)),
                "tokens": torch.randn(13, D, generator=g),
            }
            for _ in range(n)
        ]
        for E, k, f in SORT_CASES
    }


@check(
    "sort_by_destination: every kept choice once, dropped ones left out, grouped by expert, rows = its token",
    points=2,
    world_sizes=(2,),
    cases=_sort_inputs,
    returns={
        "order": Tensor((None,), torch.long, why="order is a 1-D long tensor of flat choice indices"),
        "rows": Tensor((None, D), torch.float32),
    },
)
def sort(ctx, given, got):
    for r in range(ctx.world_size):
        case, found = given[r], got[r]
        routing, k = TASKS.gate_of(case)(case["tokens"]), case["k"]
        what = (
            f"sort_by_destination ({case['E']} experts, top-{k}, capacity {routing.capacity}, "
            f"{routing.dropped} dropped)"
        )
        order = found["order"]
        kept = routing.kept.reshape(-1).nonzero().squeeze(1)
        if sorted(order.tolist()) != kept.tolist():
            extra = sorted(set(order.tolist()) - set(kept.tolist()))
            missing = sorted(set(kept.tolist()) - set(order.tolist()))
            ctx.fail(
                f"{what}: order must list each kept choice (flat index t*k + j) exactly once; "
                f"{len(order)} entries, kept {len(kept)}; not kept or repeated {extra}, missing {missing}"
            )
        experts = routing.expert_index.reshape(-1)[order]
        if bool((experts[1:] < experts[:-1]).any()):
            ctx.fail(
                f"{what}: rows must be grouped by expert in increasing order (so by destination rank); "
                f"the experts of your order are {experts.tolist()}"
            )
        ctx.expect(
            found["rows"],
            case["tokens"][order // k],
            f"{what}: rows (row i must be the token of choice order[i])",
            rank=r,
        )


def _splits(n):
    S = [[(3 * i + 5 * j + 1) % 4 + (i == j) for j in range(n)] for i in range(n)]  # rows rank i sends to j
    S[n - 1][0] = 0  # a zero split, and S is not symmetric (S[0][1] = 2)
    return S


def _exchange_inputs(n, g):
    S = _splits(n)

    def rows(i):  # rank i's rows: the value says (sender, destination, position)
        return torch.cat(
            [torch.tensor([[100.0 * i + 10 * j + p, 0.5] for p in range(S[i][j])]).reshape(-1, 2) for j in range(n)]
        )

    # torch's names (all_to_all_single): input_split_sizes = what this rank sends, output_ = what it receives
    return [
        {
            "rows": rows(r),
            "in_splits": S[r],
            "out_splits": [S[i][r] for i in range(n)],
            "probe": torch.randn(sum(S[i][r] for i in range(n)), 2, generator=g),
        }
        for r in range(n)
    ]


@check(
    "all_to_all: uneven splits forward, and in backward every row's gradient returns to its sender",
    points=2,
    world_sizes=(2, 4),
    inputs=_exchange_inputs,
    returns=lambda case, r, n: {"out": like(case["probe"]), "grad": Maybe(like(case["rows"]))},
)
def all_to_all(ctx, given, got):
    n, S = ctx.world_size, _splits(ctx.world_size)
    for r in range(n):
        what = f"all_to_all on {n} ranks, rank {r} sending {S[r]} rows and receiving {[S[i][r] for i in range(n)]}"
        expected = torch.cat([given[i]["rows"][sum(S[i][:r]) : sum(S[i][: r + 1])] for i in range(n)])
        ctx.expect(
            got[r]["out"], expected, f"{what}: received rows (value 100*sender + 10*receiver + position)", rank=r
        )
        if got[r]["grad"] is None:
            ctx.fail(f"{what}: no gradient came back to the rows sent (is AllToAll.backward sending?)")
        grad = torch.cat([given[j]["probe"][sum(S[i][j] for i in range(r)) :][: S[r][j]] for j in range(n)])
        ctx.expect(
            got[r]["grad"],
            grad,
            f"{what}: gradient of the rows sent (each should come back from the rank they went to)",
            rank=r,
            exact=False,
        )


def _experts_inputs(n, g):
    found = []
    for _ in range(n):
        recv = torch.randint(0, 4, (n, 3), generator=g)
        recv[0, 1] = 0
        found.append({"recv": recv, "received": torch.randn(int(recv.sum()), D, generator=g)})
    return found


@check(
    "compute_experts: rows regrouped by local expert, run through it, returned in arrival order",
    points=1,
    world_sizes=(2,),
    inputs=_experts_inputs,
    returns=lambda case, r, n: {"out": like(case["received"])},
)
def local_experts(ctx, given, got):
    n = ctx.world_size
    for r in range(n):
        experts = Experts(D, FF, 3 * n, 3 * r, 3, seed=SEED, init_std=INIT)
        recv, received = given[r]["recv"], given[r]["received"]
        expert_of_row = [e for j in range(n) for e in range(3) for _ in range(int(recv[j, e]))]
        with torch.no_grad():
            rows = [experts.expert(e, row[None])[0] for e, row in zip(expert_of_row, received)]
        expected = torch.stack(rows) if rows else received.new_zeros((0, D))  # a rank may receive no rows at all
        ctx.expect(
            got[r]["out"],
            expected,
            f"compute_experts with recv_counts {recv.tolist()} (row j = sender, "
            "column = local expert): row i must be its expert's output",
            rank=r,
            exact=False,
        )


def _combine_inputs(n, g):
    return [
        {
            "E": 4,
            "k": 2,
            "factor": 0.75,
            "gate_seed": int(torch.randint(0, 2**31, (), generator=g)),
            "tokens": torch.randn(11, D, generator=g),
            "answers": torch.randn(22, D, generator=g),
            "probe": torch.randn(11, D, generator=g),
        }
        for _ in range(n)
    ]


@check(
    "combine: each token adds its kept experts' answers times the gate weights, differentiably",
    points=1,
    world_sizes=(2,),
    task="weighted_sum",
    inputs=_combine_inputs,
    returns=lambda case, r, n: {
        "out": like(case["tokens"]),
        "answers_grad": Maybe(Tensor((None, D), torch.float32)),
        "router_grad": bool,
    },
)
def weighted_sum(ctx, given, got):
    for r in range(ctx.world_size):
        case, k = given[r], given[r]["k"]
        routing = TASKS.gate_of(case)(case["tokens"])
        order = TASKS.kept_order(routing, k)
        answers = case["answers"][: len(order)]
        weights = routing.gate_weight.detach().reshape(-1)
        expected = torch.zeros(case["tokens"].shape[0], D)
        for i, c in enumerate(order.tolist()):
            expected[c // k] += weights[c] * answers[i]
        what = f"combine of {len(order)} kept choices ({routing.dropped} dropped) for 11 tokens, top-{k}"
        ctx.expect(got[r]["out"], expected, f"{what}: output", rank=r, exact=False)
        if got[r]["answers_grad"] is None or not got[r]["router_grad"]:
            ctx.fail(f"{what}: the output must be differentiable with respect to the answers and the gate weights")
        ctx.expect(
            got[r]["answers_grad"],
            weights[order, None] * case["probe"][order // k],
            f"{what}: gradient of the answers",
            rank=r,
            exact=False,
        )


# --- the whole layer -----------------------------------------------------------------------------------
def judge_layer(ctx, given, got):
    """Rank r's LabMoE against the brute force on every rank's tokens: outputs, gradients."""
    n, options = ctx.world_size, given[0]["options"]
    what = (
        f"{ctx.case} ({options['num_experts']} experts over {n} ranks, top-{options['top_k']}, capacity factor "
        f"{options['capacity_factor']})"
    )
    reference = MoE(D, FF, seed=SEED, init_std=INIT, name="reference", **options)
    if given[0]["skew"]:
        TASKS.skewed(reference)
    xs = [given[r]["x"].clone().requires_grad_(True) for r in range(n)]
    outs, auxes = reference_moe(reference, xs)
    sum((o * given[r]["probe"]).sum() + a for r, (o, a) in enumerate(zip(outs, auxes))).backward()
    local = max(1, options["num_experts"] // n)  # the layer's experts per rank (given code), rank r's from r·local
    for r in range(n):
        found = got[r]
        if "x_grad" not in found:
            out = found["out"]
            ctx.fail(
                f"{what}: rank {r}'s layer returned {type(out).__name__} of shape {getattr(out, 'shape', '?')}, "
                f"expected the input's shape {tuple(xs[r].shape)}"
            )
        ctx.expect(found["out"], outs[r].detach(), f"{what}: layer output", rank=r, exact=False)
        if found["x_grad"] is None:
            ctx.fail(
                f"{what}: no gradient reached rank {r}'s layer input: is every step differentiable "
                f"(the all-to-all's backward, the weighted sum)?"
            )
        ctx.expect(found["x_grad"], xs[r].grad, f"{what}: gradient of the layer's input", rank=r, exact=False)
        first = r * local
        for w in WEIGHTS:
            if found["grads"][w] is None:
                ctx.fail(
                    f"{what}: expert weight {w} of rank {r}'s experts got no gradient: do the rows reach "
                    f"the experts through your all-to-all, and do the answers come back through it?"
                )
            want = getattr(reference.experts, w).grad[first : first + local]
            ctx.expect(
                found["grads"][w],
                want,
                f"{what}: gradient of {w} of experts {first}..{first + local - 1}",
                rank=r,
                exact=False,
            )


def layer_returned(case, r, n):
    """The layer's output, the gradients of its input and of this rank's experts, the choices it dropped; or, when
    the output does not have the input's shape, the output alone."""
    local = max(1, case["options"]["num_experts"] // n)
    with torch.device("meta"):
        weights = Experts(D, FF, local, 0, local, seed=SEED, init_std=INIT)
    return Either(
        {
            "out": like(case["x"]),
            "x_grad": Maybe(like(case["x"])),
            "dropped": Maybe(int),
            "grads": {w: Maybe(like(getattr(weights, w))) for w in WEIGHTS},
        },
        {"out": Either(Tensor(), None, float)},
    )


def configs(n):
    return {
        "one expert per rank, top-1, dropping": dict(num_experts=n, top_k=1, capacity_factor=0.5),
        "two experts per rank, top-2, dropping": dict(num_experts=2 * n, top_k=2, capacity_factor=0.5),
        "two experts per rank, top-2, no drops": dict(num_experts=2 * n, top_k=2, capacity_factor=float(2 * n)),
        "one expert per rank, top-2": dict(num_experts=n, top_k=2, capacity_factor=1.0),
    }


def layer_inputs(named, skew=False):
    def make(n, g):
        found = {}
        for name, options in named(n).items():
            found[name] = [
                {"options": options, "skew": skew, "x": x, "probe": probe} for x, probe in tokens(n, g, skew)
            ]
        return found

    return make


@check(
    "the layer equals the one-process reference: outputs, input and expert gradients, top-1/top-2, with drops",
    points=3,
    world_sizes=(2, 4),
    task="layer",
    cases=layer_inputs(configs),
    returns=layer_returned,
)
def whole_layer(ctx, given, got):
    judge_layer(ctx, given, got)


def skew_config(n):
    return {"extreme skew": dict(num_experts=max(4, 2 * n), top_k=2, capacity_factor=1.0)}


@check(
    "extreme skew: every token picks the same experts; exact, dropping only what capacity demands",
    points=1,
    world_sizes=(2, 4),
    task="layer",
    cases=layer_inputs(skew_config, skew=True),
    returns=layer_returned,
)
def extreme_skew(ctx, given, got):
    judge_layer(ctx, given, got)
    for r in range(ctx.world_size):
        options = given[r]["options"]
        T = given[r]["x"].shape[0] * given[r]["x"].shape[1]
        C = capacity(T, options["num_experts"], options["top_k"], options["capacity_factor"])
        if got[r]["dropped"] != 2 * (T - min(T, C)):
            ctx.fail(
                f"extreme skew: rank {r}'s {T} tokens all choose the same 2 experts with capacity {C}, so "
                f"{2 * (T - min(T, C))} choices must be dropped; the layer's load record says {got[r]['dropped']}"
            )


def _rows_to_each_rank(n, x):
    """How many rows rank r's tokens `x` send to each rank in the trace's layer (the gate is given code)."""
    gate = MoE(D, FF, 2 * n, top_k=2, seed=SEED, init_std=INIT).gate
    with torch.no_grad():
        kept = gate(x.reshape(-1, D)).kept_counts
    return kept.reshape(n, 2).sum(1).tolist()


def _asymmetric_tokens(n, g):
    """Tokens drawn until some rank sends another more rows than it gets back (about 1 draw in 60 at world 2 is
    symmetric): only then does a backward that forgets to swap the splits move the wrong sizes."""
    while True:
        drawn = tokens(n, g)
        rows = [_rows_to_each_rank(n, x) for x, _ in drawn]
        if any(rows[r][j] != rows[j][r] for r in range(n) for j in range(r)):
            return [{"x": x, "probe": p} for x, p in drawn]


@check(
    "the trace: one layer's forward and backward are exactly counts, dispatch, combine, combine backward, "
    "dispatch backward",
    points=1,
    world_sizes=(2,),
    inputs=_asymmetric_tokens,
    returns={"calls": [COMM], "labels": [Maybe(str)]},
)
def trace(ctx, given, got):
    """Judged on what the grader's relay carried for each rank (never on a trace the rank wrote): five
    all-to-alls over the whole group, each of the size the routing gives; and the labels on the rank's own trace
    (the README's rule: they name each call on the student's timeline, and decide nothing about the traffic)."""
    n = ctx.world_size
    rows = [_rows_to_each_rank(n, given[r]["x"]) for r in range(n)]
    for r in range(n):
        calls = got[r]["calls"]
        sends = [[s * D for s in rows[r]], [rows[j][r] * D for j in range(n)]]  # dispatch: sent, received
        expected = [("all_to_all", "int64", [2] * n, [2] * n)] + [
            ("all_to_all", "float32", *(sends if role in ("dispatch", "combine backward") else sends[::-1]))
            for role in ROLES[1:]
        ]
        carried = [(c["name"], c["args"].get("dtype"), c["args"].get("sent"), c["args"].get("received")) for c in calls]
        groups = [c["args"].get("group") for c in calls]
        if carried != expected or any(g != list(range(n)) for g in groups):
            ctx.fail(
                f"rank {r}: one forward and backward made the grader's relay carry {_said(carried, groups)}; expected "
                f"five all-to-alls over all {n} ranks through send_rows, in this order: {', '.join(ROLES)} (the "
                "count exchange, the two of the forward, then autograd's two in reverse), of the sizes the routing "
                f"gives ({_said(expected, [list(range(n))] * 5)}), and no other collective"
            )
        if got[r]["labels"] != ROLES:
            ctx.fail(
                f"rank {r}: the all-to-alls are right, but send_rows labelled them {got[r]['labels']} on this rank's "
                f"trace; expected {ROLES} (the backward's label is the forward's + ' backward')"
            )


def _said(calls, groups) -> str:
    if not calls:
        return "no collective"
    return "; ".join(
        f"{name} of {dtype} over ranks {group}" + (f", elements sent {sent}, received {received}" if sent else "")
        for (name, dtype, sent, received), group in zip(calls, groups)
    )
