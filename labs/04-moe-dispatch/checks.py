"""The graded checks of lab 04 (MoE dispatch and combine). Each runs on every rank of a real job.

Every rank can rebuild every rank's inputs from seeds, so it can compute the right answer on its own:
the pieces are checked one by one against small hand-computable cases, and the whole layer against
`toolkit.moe.reference_moe`, the one-process brute force that holds every expert (built here on a
group of one rank: same seed, hence the same weights as the experts spread over the ranks).
"""
import zlib

import torch
import torch.distributed as dist

from toolkit.grading import check
from toolkit.moe import MoE, TopKGate, reference_moe
from toolkit.moe.experts import WEIGHTS, Experts
from toolkit.trace.events import recorder

D, FF, SEED, INIT = 8, 16, 7, 0.3
ROLES = ["counts", "dispatch", "combine", "combine backward", "dispatch backward"]


def generator(*keys) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32("/".join(map(str, keys)).encode()))


def tokens_of(tag, world, rank):
    """Rank r's tokens, (2, 3 + 2r, D): every rank routes a different number; and a probe for the loss."""
    g = generator(tag, world, rank)
    x = torch.randn(2, 3 + 2 * rank, D, generator=g)
    return x, torch.randn(x.shape, generator=g)


def alone(ctx):
    """A process group holding only this rank: an MoE built on it holds every expert (the reference)."""
    mine, _ = dist.new_subgroups_by_enumeration([[r] for r in range(ctx.world_size)])
    return mine


def skewed(layer):
    """Every token's scores put the last expert first and expert 0 second (feature 0 is set to 1)."""
    with torch.no_grad():
        E = layer.num_experts
        scores = -0.1 * torch.arange(1, E + 1, dtype=torch.float32)
        scores[E - 1], scores[0] = 2.0, 1.0
        layer.gate.router.weight.zero_()
        layer.gate.router.weight[:, 0] = scores
    return layer


def layer_against_reference(student, ctx, name, options, skew=False, group_of_one=None):
    """The student's layer on this rank's tokens vs the brute force on every rank's: outputs, gradients."""
    n, r = ctx.world_size, ctx.rank
    what = (f"{name} ({options['num_experts']} experts over {n} ranks, top-{options['top_k']}, capacity factor "
            f"{options['capacity_factor']})")
    layer = student.LabMoE(D, FF, group=ctx.group, seed=SEED, init_std=INIT, name="lab", **options)
    reference = MoE(D, FF, group=group_of_one, seed=SEED, init_std=INIT, name="reference", **options)
    if skew:
        skewed(layer), skewed(reference)
    inputs = [tokens_of(name, n, rank) for rank in range(n)]
    if skew:
        for x, _ in inputs:
            x[..., 0] = 1.0
    xs = [x.clone().requires_grad_(True) for x, _ in inputs]
    outs, auxes = reference_moe(reference, xs)
    sum((o * p).sum() + a for o, (_, p), a in zip(outs, inputs, auxes)).backward()

    x, probe = inputs[r][0].clone().requires_grad_(True), inputs[r][1]
    out, aux = layer(x)
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        ctx.fail(f"{what}: the layer returned {type(out).__name__} of shape {getattr(out, 'shape', '?')}, "
                 f"expected the input's shape {tuple(x.shape)}")
    ctx.expect(out.detach(), outs[r].detach(), f"{what}: layer output", exact=False)
    ((out * probe).sum() + aux).backward()
    if x.grad is None:
        ctx.fail(f"{what}: no gradient reached the layer's input: is every step differentiable "
                 f"(the all-to-all's backward, the weighted sum)?")
    ctx.expect(x.grad, xs[r].grad, f"{what}: gradient of the layer's input", exact=False)
    first, local = layer.experts.first, layer.num_local
    for w in WEIGHTS:
        got = getattr(layer.experts, w).grad
        if got is None:
            ctx.fail(f"{what}: expert weight {w} of this rank's experts got no gradient: do the rows reach "
                     f"the experts through your all-to-all, and do the answers come back through it?")
        want = getattr(reference.experts, w).grad[first:first + local]
        ctx.expect(got, want, f"{what}: gradient of {w} of experts {first}..{first + local - 1}", exact=False)
    return layer, recorder.metrics[-1]["value"] if recorder.metrics else None


# --- the pieces ----------------------------------------------------------------------------------------
@check("exchange_counts: every rank learns how many rows it gets from each rank for each of its experts",
       points=2, world_sizes=(2, 4))
def counts(student, ctx):
    n = ctx.world_size
    for per_rank in (1, 2):
        E = per_rank * n
        everyone = [torch.randint(0, 9, (E,), generator=generator("counts", n, per_rank, r)) for r in range(n)]
        send, recv = student.exchange_counts(everyone[ctx.rank].clone(), n, per_rank, ctx.group)
        what = f"exchange_counts with {E} experts over {n} ranks (this rank's kept counts {everyone[ctx.rank].tolist()})"
        ctx.expect(send, everyone[ctx.rank].reshape(n, per_rank), f"{what}: send")
        expected = torch.stack([everyone[j].reshape(n, per_rank)[ctx.rank] for j in range(n)])
        ctx.expect(recv, expected, f"{what}: recv (row j: what rank j sends to this rank's experts)")


@check("sort_by_destination: every kept choice once, dropped ones left out, grouped by expert, rows = its token",
       points=2, world_sizes=(2,))
def sort(student, ctx):
    for E, k, factor in ((4, 2, 0.75), (6, 1, 0.5), (4, 2, 4.0)):
        torch.manual_seed(ctx.rank)
        gate = TopKGate(D, E, k, factor)
        tokens = torch.randn(13, D, generator=generator("sort", E, k, ctx.rank))
        routing = gate(tokens)
        what = f"sort_by_destination ({E} experts, top-{k}, capacity {routing.capacity}, {routing.dropped} dropped)"
        order, rows = student.sort_by_destination(tokens, routing)
        if not isinstance(order, torch.Tensor) or order.dtype != torch.long or order.dim() != 1:
            ctx.fail(f"{what}: order must be a 1-D long tensor of flat choice indices, got {order!r}")
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
        ctx.expect(rows, tokens[order // k], f"{what}: rows (row i must be the token of choice order[i])")


@check("all_to_all: uneven splits forward, and in backward every row's gradient returns to its sender",
       points=2, world_sizes=(2, 4))
def all_to_all(student, ctx):
    n, r = ctx.world_size, ctx.rank
    S = [[(3 * i + 5 * j + 1) % 4 + (i == j) for j in range(n)] for i in range(n)]  # rows rank i sends to j
    S[n - 1][0] = 0                                 # a zero split, and S is not symmetric (S[0][1] = 2)

    def rows(i):  # rank i's rows: the value says (sender, destination, position)
        return torch.cat([torch.tensor([[100.0 * i + 10 * j + p, 0.5] for p in range(S[i][j])]).reshape(-1, 2)
                          for j in range(n)])

    def probe(j):
        return torch.randn(sum(S[i][j] for i in range(n)), 2, generator=generator("probe", n, j))

    x = rows(r).requires_grad_(True)
    out = student.all_to_all(x, [S[i][r] for i in range(n)], S[r], ctx.group, "lab")
    what = f"all_to_all on {n} ranks, rank {r} sending {S[r]} rows and receiving {[S[i][r] for i in range(n)]}"
    ctx.expect(out.detach(), torch.cat([rows(i)[sum(S[i][:r]):sum(S[i][:r + 1])] for i in range(n)]),
               f"{what}: received rows (value 100*sender + 10*receiver + position)")
    (out * probe(r)).sum().backward()
    if x.grad is None:
        ctx.fail(f"{what}: no gradient came back to the rows sent (is AllToAll.backward sending?)")
    expected = torch.cat([probe(j)[sum(S[i][j] for i in range(r)):][:S[r][j]] for j in range(n)])
    ctx.expect(x.grad, expected, f"{what}: gradient of the rows sent (each should come back from the rank they "
                                 f"went to)", exact=False)


@check("compute_experts: rows regrouped by local expert, run through it, returned in arrival order",
       points=1, world_sizes=(2,))
def local_experts(student, ctx):
    n = ctx.world_size
    experts = Experts(D, FF, 3 * n, 3 * ctx.rank, 3, seed=SEED, init_std=INIT)
    recv = torch.randint(0, 4, (n, 3), generator=generator("experts", ctx.rank))
    recv[0, 1] = 0
    received = torch.randn(int(recv.sum()), D, generator=generator("rows", ctx.rank))
    expert_of_row = [e for j in range(n) for e in range(3) for _ in range(int(recv[j, e]))]
    with torch.no_grad():
        expected = torch.stack([experts.expert(e, row[None])[0] for e, row in zip(expert_of_row, received)])
        got = student.compute_experts(experts, received, recv)
    ctx.expect(got, expected, f"compute_experts with recv_counts {recv.tolist()} (row j = sender, column = local "
                              f"expert): row i must be its expert's output", exact=False)


@check("combine: each token adds its kept experts' answers times the gate weights, differentiably",
       points=1, world_sizes=(2,))
def weighted_sum(student, ctx):
    E, k = 4, 2
    torch.manual_seed(10 + ctx.rank)
    gate = TopKGate(D, E, k, 0.75)
    tokens = torch.randn(11, D, generator=generator("combine", ctx.rank))
    routing = gate(tokens)
    choices = [(int(routing.expert_index.reshape(-1)[c]), c) for c in range(routing.kept.numel())
               if bool(routing.kept.reshape(-1)[c])]
    order = torch.tensor([c for _, c in sorted(choices)], dtype=torch.long)
    answers = torch.randn(len(order), D, generator=generator("answers", ctx.rank)).requires_grad_(True)
    weights = routing.gate_weight.detach().reshape(-1)
    expected = torch.zeros(tokens.shape[0], D)
    for i, c in enumerate(order.tolist()):
        expected[c // k] += weights[c] * answers.detach()[i]
    out = student.combine(answers, routing, order, tokens.shape[0])
    what = f"combine of {len(order)} kept choices ({routing.dropped} dropped) for 11 tokens, top-{k}"
    ctx.expect(out.detach(), expected, f"{what}: output", exact=False)
    probe = torch.randn(out.shape, generator=generator("probe", ctx.rank))
    (out * probe).sum().backward()
    if answers.grad is None or gate.router.weight.grad is None:
        ctx.fail(f"{what}: the output must be differentiable with respect to the answers and the gate weights")
    ctx.expect(answers.grad, weights[order, None] * probe[order // k], f"{what}: gradient of the answers",
               exact=False)


# --- the whole layer -----------------------------------------------------------------------------------
@check("the layer equals the one-process reference: outputs, input and expert gradients, top-1/top-2, with drops",
       points=3, world_sizes=(2, 4))
def whole_layer(student, ctx):
    n, group = ctx.world_size, alone(ctx)
    configs = {"one expert per rank, top-1, dropping": dict(num_experts=n, top_k=1, capacity_factor=0.5),
               "two experts per rank, top-2, dropping": dict(num_experts=2 * n, top_k=2, capacity_factor=0.5),
               "two experts per rank, top-2, no drops": dict(num_experts=2 * n, top_k=2, capacity_factor=float(2 * n)),
               "one expert per rank, top-2": dict(num_experts=n, top_k=2, capacity_factor=1.0)}
    for name, options in configs.items():
        layer_against_reference(student, ctx, name, options, group_of_one=group)


@check("extreme skew: every token picks the same experts; exact, dropping only what capacity demands",
       points=1, world_sizes=(2, 4))
def extreme_skew(student, ctx):
    n, group = ctx.world_size, alone(ctx)
    options = dict(num_experts=max(4, 2 * n), top_k=2, capacity_factor=1.0)
    layer, load = layer_against_reference(student, ctx, "skew", options, skew=True, group_of_one=group)
    T = 2 * (3 + 2 * ctx.rank)
    C = load["capacity"] if load else None
    if load is None or load["dropped"] != 2 * (T - min(T, C)):
        ctx.fail(f"extreme skew: {T} tokens all choose the same 2 experts with capacity {C}, so "
                 f"{2 * (T - min(T, C or 0))} choices must be dropped; the layer's load record says "
                 f"{load and load['dropped']}")


@check("the trace: one layer's forward and backward are exactly counts, dispatch, combine, combine backward, "
       "dispatch backward", points=1, world_sizes=(2,))
def trace(student, ctx):
    layer = student.LabMoE(D, FF, 2 * ctx.world_size, top_k=2, group=ctx.group, seed=SEED, init_std=INIT)
    x, probe = tokens_of("trace", ctx.world_size, ctx.rank)
    recorder.reset()
    out, aux = layer(x.requires_grad_(True))
    ((out * probe).sum() + aux).backward()
    calls = [(e["name"], e["args"].get("moe")) for e in recorder.events if e["cat"] == "comm"]
    if calls != [("all_to_all", role) for role in ROLES]:
        ctx.fail(f"one forward and backward issued {calls}; expected five all-to-alls through send_rows, labelled "
                 f"{ROLES} in that order (the count exchange, the two of the forward, then autograd's two in "
                 f"reverse), and no other collective")
