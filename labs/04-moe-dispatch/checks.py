"""The graded checks of lab 04 (MoE dispatch and combine), judged in the grader's process.

The grader draws every rank's tokens, sends each rank its own, and computes the right answer here: the
pieces against small hand-computable cases, the whole layer against `toolkit.moe.reference_moe`, the
one-process brute force that holds every expert (same seed, hence the same weights as the experts spread
over the ranks).
"""
import torch

from toolkit.grading import check, sibling
from toolkit.moe import MoE, reference_moe
from toolkit.moe.experts import WEIGHTS, Experts

ANSWERS = {"toolkit.moe.layer:MoE.forward": "the toolkit's own MoE layer",
           "toolkit.moe.layer:MoE.exchange_counts": "the toolkit's own count exchange",
           "toolkit.moe.layer:MoE.sort_by_destination": "the toolkit's own dispatch order",
           "toolkit.moe.layer:MoE.dispatch_compute_combine": "the toolkit's own dispatch and combine",
           "toolkit.moe.layer:MoE.compute_experts": "the toolkit's own local experts",
           "toolkit.moe.layer:MoE.weighted_sum": "the toolkit's own combine",
           "toolkit.moe.layer:all_to_all": "the toolkit's own differentiable all-to-all"}
D, FF, SEED, INIT = 8, 16, 7, 0.3
ROLES = ["counts", "dispatch", "combine", "combine backward", "dispatch backward"]


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
    kept = {per_rank: [torch.randint(0, 9, (per_rank * n,), generator=g) for _ in range(n)] for per_rank in (1, 2)}
    return [{"cases": [{"kept": kept[p][r], "per_rank": p} for p in (1, 2)]} for r in range(n)]


@check("exchange_counts: every rank learns how many rows it gets from each rank for each of its experts",
       points=2, world_sizes=(2, 4), inputs=_counts_inputs)
def counts(ctx, given, got):
    n = ctx.world_size
    for k, per_rank in enumerate((1, 2)):
        everyone = [given[r]["cases"][k]["kept"] for r in range(n)]
        for r in range(n):
            what = f"exchange_counts with {per_rank * n} experts over {n} ranks (rank {r}'s kept counts " \
                   f"{everyone[r].tolist()})"
            ctx.expect(got[r]["cases"][k]["send"], everyone[r].reshape(n, per_rank), f"{what}: send", rank=r)
            expected = torch.stack([everyone[j].reshape(n, per_rank)[r] for j in range(n)])
            ctx.expect(got[r]["cases"][k]["recv"], expected, f"{what}: recv (row j: what rank j sends to this "
                       "rank's experts)", rank=r)


SORT_CASES = ((4, 2, 0.75), (6, 1, 0.5), (4, 2, 4.0))


def _sort_inputs(n, g):
    return [{"cases": [{"E": E, "k": k, "factor": f, "gate_seed": int(torch.randint(0, 2**31, (), generator=g)),
                        "tokens": torch.randn(13, D, generator=g)} for E, k, f in SORT_CASES]} for _ in range(n)]


@check("sort_by_destination: every kept choice once, dropped ones left out, grouped by expert, rows = its token",
       points=2, world_sizes=(2,), inputs=_sort_inputs)
def sort(ctx, given, got):
    for r in range(ctx.world_size):
        for case, found in zip(given[r]["cases"], got[r]["cases"]):
            routing, k = TASKS.gate_of(case)(case["tokens"]), case["k"]
            what = (f"sort_by_destination ({case['E']} experts, top-{k}, capacity {routing.capacity}, "
                    f"{routing.dropped} dropped)")
            order = found["order"]
            if not isinstance(order, torch.Tensor) or order.dtype != torch.long or order.dim() != 1:
                ctx.fail(f"{what}: order must be a 1-D long tensor of flat choice indices, got {order!r:.100}")
            kept = routing.kept.reshape(-1).nonzero().squeeze(1)
            if sorted(order.tolist()) != kept.tolist():
                extra = sorted(set(order.tolist()) - set(kept.tolist()))
                missing = sorted(set(kept.tolist()) - set(order.tolist()))
                ctx.fail(f"{what}: order must list each kept choice (flat index t*k + j) exactly once; "
                         f"{len(order)} entries, kept {len(kept)}; not kept or repeated {extra}, missing {missing}")
            experts = routing.expert_index.reshape(-1)[order]
            if bool((experts[1:] < experts[:-1]).any()):
                ctx.fail(f"{what}: rows must be grouped by expert in increasing order (so by destination rank); "
                         f"the experts of your order are {experts.tolist()}")
            ctx.expect(found["rows"], case["tokens"][order // k], f"{what}: rows (row i must be the token of choice "
                       "order[i])", rank=r)


def _splits(n):
    S = [[(3 * i + 5 * j + 1) % 4 + (i == j) for j in range(n)] for i in range(n)]  # rows rank i sends to j
    S[n - 1][0] = 0                                 # a zero split, and S is not symmetric (S[0][1] = 2)
    return S


def _exchange_inputs(n, g):
    S = _splits(n)

    def rows(i):  # rank i's rows: the value says (sender, destination, position)
        return torch.cat([torch.tensor([[100.0 * i + 10 * j + p, 0.5] for p in range(S[i][j])]).reshape(-1, 2)
                          for j in range(n)])
    # torch's names (all_to_all_single): input_split_sizes = what this rank sends, output_ = what it receives
    return [{"rows": rows(r), "in_splits": S[r], "out_splits": [S[i][r] for i in range(n)],
             "probe": torch.randn(sum(S[i][r] for i in range(n)), 2, generator=g)} for r in range(n)]


@check("all_to_all: uneven splits forward, and in backward every row's gradient returns to its sender",
       points=2, world_sizes=(2, 4), inputs=_exchange_inputs)
def all_to_all(ctx, given, got):
    n, S = ctx.world_size, _splits(ctx.world_size)
    for r in range(n):
        what = f"all_to_all on {n} ranks, rank {r} sending {S[r]} rows and receiving {[S[i][r] for i in range(n)]}"
        expected = torch.cat([given[i]["rows"][sum(S[i][:r]):sum(S[i][:r + 1])] for i in range(n)])
        ctx.expect(got[r]["out"], expected, f"{what}: received rows (value 100*sender + 10*receiver + position)",
                   rank=r)
        if got[r]["grad"] is None:
            ctx.fail(f"{what}: no gradient came back to the rows sent (is AllToAll.backward sending?)")
        grad = torch.cat([given[j]["probe"][sum(S[i][j] for i in range(r)):][:S[r][j]] for j in range(n)])
        ctx.expect(got[r]["grad"], grad, f"{what}: gradient of the rows sent (each should come back from the rank "
                   "they went to)", rank=r, exact=False)


def _experts_inputs(n, g):
    found = []
    for _ in range(n):
        recv = torch.randint(0, 4, (n, 3), generator=g)
        recv[0, 1] = 0
        found.append({"recv": recv, "received": torch.randn(int(recv.sum()), D, generator=g)})
    return found


@check("compute_experts: rows regrouped by local expert, run through it, returned in arrival order",
       points=1, world_sizes=(2,), inputs=_experts_inputs)
def local_experts(ctx, given, got):
    n = ctx.world_size
    for r in range(n):
        experts = Experts(D, FF, 3 * n, 3 * r, 3, seed=SEED, init_std=INIT)
        recv, received = given[r]["recv"], given[r]["received"]
        expert_of_row = [e for j in range(n) for e in range(3) for _ in range(int(recv[j, e]))]
        with torch.no_grad():
            expected = torch.stack([experts.expert(e, row[None])[0] for e, row in zip(expert_of_row, received)])
        ctx.expect(got[r]["out"], expected, f"compute_experts with recv_counts {recv.tolist()} (row j = sender, "
                   "column = local expert): row i must be its expert's output", rank=r, exact=False)


def _combine_inputs(n, g):
    return [{"E": 4, "k": 2, "factor": 0.75, "gate_seed": int(torch.randint(0, 2**31, (), generator=g)),
             "tokens": torch.randn(11, D, generator=g), "answers": torch.randn(22, D, generator=g),
             "probe": torch.randn(11, D, generator=g)} for _ in range(n)]


@check("combine: each token adds its kept experts' answers times the gate weights, differentiably",
       points=1, world_sizes=(2,), task="weighted_sum", inputs=_combine_inputs)
def weighted_sum(ctx, given, got):
    for r in range(ctx.world_size):
        case, k = given[r], given[r]["k"]
        routing = TASKS.gate_of(case)(case["tokens"])
        order = TASKS.kept_order(routing, k)
        answers = case["answers"][:len(order)]
        weights = routing.gate_weight.detach().reshape(-1)
        expected = torch.zeros(case["tokens"].shape[0], D)
        for i, c in enumerate(order.tolist()):
            expected[c // k] += weights[c] * answers[i]
        what = f"combine of {len(order)} kept choices ({routing.dropped} dropped) for 11 tokens, top-{k}"
        ctx.expect(got[r]["out"], expected, f"{what}: output", rank=r, exact=False)
        if got[r]["answers_grad"] is None or not got[r]["router_grad"]:
            ctx.fail(f"{what}: the output must be differentiable with respect to the answers and the gate weights")
        ctx.expect(got[r]["answers_grad"], weights[order, None] * case["probe"][order // k],
                   f"{what}: gradient of the answers", rank=r, exact=False)


# --- the whole layer -----------------------------------------------------------------------------------
def judge_layer(ctx, given, got, name, k):
    """Rank r's LabMoE against the brute force on every rank's tokens: outputs, gradients."""
    n, case = ctx.world_size, given[0]["cases"][k]
    options = case["options"]
    what = (f"{name} ({options['num_experts']} experts over {n} ranks, top-{options['top_k']}, capacity factor "
            f"{options['capacity_factor']})")
    reference = MoE(D, FF, seed=SEED, init_std=INIT, name="reference", **options)
    if case["skew"]:
        TASKS.skewed(reference)
    xs = [given[r]["cases"][k]["x"].clone().requires_grad_(True) for r in range(n)]
    outs, auxes = reference_moe(reference, xs)
    sum((o * given[r]["cases"][k]["probe"]).sum() + a for r, (o, a) in enumerate(zip(outs, auxes))).backward()
    for r in range(n):
        found = got[r]["cases"][k]
        out = found["out"]
        if not isinstance(out, torch.Tensor) or out.shape != xs[r].shape:
            ctx.fail(f"{what}: rank {r}'s layer returned {type(out).__name__} of shape {getattr(out, 'shape', '?')}, "
                     f"expected the input's shape {tuple(xs[r].shape)}")
        ctx.expect(out, outs[r].detach(), f"{what}: layer output", rank=r, exact=False)
        if found["x_grad"] is None:
            ctx.fail(f"{what}: no gradient reached rank {r}'s layer input: is every step differentiable "
                     f"(the all-to-all's backward, the weighted sum)?")
        ctx.expect(found["x_grad"], xs[r].grad, f"{what}: gradient of the layer's input", rank=r, exact=False)
        first, local = found["first"], found["local"]
        for w in WEIGHTS:
            if found["grads"][w] is None:
                ctx.fail(f"{what}: expert weight {w} of rank {r}'s experts got no gradient: do the rows reach "
                         f"the experts through your all-to-all, and do the answers come back through it?")
            want = getattr(reference.experts, w).grad[first:first + local]
            ctx.expect(found["grads"][w], want, f"{what}: gradient of {w} of experts {first}..{first + local - 1}",
                       rank=r, exact=False)


def configs(n):
    return {"one expert per rank, top-1, dropping": dict(num_experts=n, top_k=1, capacity_factor=0.5),
            "two experts per rank, top-2, dropping": dict(num_experts=2 * n, top_k=2, capacity_factor=0.5),
            "two experts per rank, top-2, no drops": dict(num_experts=2 * n, top_k=2, capacity_factor=float(2 * n)),
            "one expert per rank, top-2": dict(num_experts=n, top_k=2, capacity_factor=1.0)}


def layer_inputs(named, skew=False):
    def make(n, g):
        options = named(n)
        drawn = {name: tokens(n, g, skew) for name in options}
        return [{"cases": [{"options": o, "skew": skew, "x": drawn[name][r][0], "probe": drawn[name][r][1]}
                           for name, o in options.items()]} for r in range(n)]
    return make


@check("the layer equals the one-process reference: outputs, input and expert gradients, top-1/top-2, with drops",
       points=3, world_sizes=(2, 4), task="layer", inputs=layer_inputs(configs))
def whole_layer(ctx, given, got):
    for k, name in enumerate(configs(ctx.world_size)):
        judge_layer(ctx, given, got, name, k)


def skew_config(n):
    return {"skew": dict(num_experts=max(4, 2 * n), top_k=2, capacity_factor=1.0)}


@check("extreme skew: every token picks the same experts; exact, dropping only what capacity demands",
       points=1, world_sizes=(2, 4), task="layer", inputs=layer_inputs(skew_config, skew=True))
def extreme_skew(ctx, given, got):
    judge_layer(ctx, given, got, "skew", 0)
    for r in range(ctx.world_size):
        load = got[r]["cases"][0]["load"]
        T = 2 * (3 + 2 * r)
        C = load["capacity"] if isinstance(load, dict) else None
        if not isinstance(load, dict) or load["dropped"] != 2 * (T - min(T, C)):
            ctx.fail(f"extreme skew: rank {r}'s {T} tokens all choose the same 2 experts with capacity {C}, so "
                     f"{2 * (T - min(T, C or 0))} choices must be dropped; the layer's load record says "
                     f"{load and load['dropped']}")


@check("the trace: one layer's forward and backward are exactly counts, dispatch, combine, combine backward, "
       "dispatch backward", points=1, world_sizes=(2,),
       inputs=lambda n, g: [{"x": x, "probe": p} for x, p in tokens(n, g)])
def trace(ctx, given, got):
    for r in range(ctx.world_size):
        calls = [tuple(c) for c in got[r]["calls"]]
        if calls != [("all_to_all", role) for role in ROLES]:
            ctx.fail(f"rank {r}: one forward and backward issued {calls}; expected five all-to-alls through "
                     f"send_rows, labelled {ROLES} in that order (the count exchange, the two of the forward, then "
                     "autograd's two in reverse), and no other collective")
