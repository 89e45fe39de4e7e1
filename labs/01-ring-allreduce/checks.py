"""The graded checks of lab 01 (ring all-reduce). Each runs on every rank of a real job.

Every rank builds every rank's input from the same seed, so each can compute the right answer on its
own and say exactly what differs ("all_reduce SUM of 7 float32 elements: rank 1 got [...] expected [...]").
When the numbers are a recognisable mistake, it says which instead of showing floats: a chunk that
holds another chunk's finished reduction (the ring's indices shifted; the lecture's convention, where
rank r ends with chunk r+1, is the commonest), a chunk reduced over only some ranks (a step missing,
or a received chunk not combined), or an all-gather block that holds another rank's input.
"""
import itertools

import torch
import torch.distributed as dist

import toolkit
from toolkit.grading import check

SUM, MAX, MIN, PRODUCT = dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT
REDUCE = {SUM: lambda xs: torch.stack(xs).sum(0), PRODUCT: lambda xs: torch.stack(xs).prod(0),
          MAX: lambda xs: torch.stack(xs).amax(0), MIN: lambda xs: torch.stack(xs).amin(0)}
NAMES = {SUM: "SUM", PRODUCT: "PRODUCT", MAX: "MAX", MIN: "MIN"}


def inputs(n, numel, dtype=torch.float32, op=SUM, seed=0):
    """Every rank's input (rank r's is inputs[r]); products use small values so nothing overflows."""
    g = torch.Generator().manual_seed(seed * 1000 + numel)
    if op == PRODUCT:
        return [(torch.randint(1, 3, (numel,), generator=g) * (2 * torch.randint(0, 2, (numel,), generator=g) - 1))
                .to(dtype) for _ in range(n)]
    if dtype.is_floating_point:
        return [torch.randn(numel, generator=g, dtype=torch.float64).to(dtype) for _ in range(n)]
    return [torch.randint(-100, 100, (numel,), generator=g).to(dtype) for _ in range(n)]


# --- recognising a mistake -----------------------------------------------------------------------------
def _same(a, b, exact) -> bool:
    return a.shape == b.shape and bool((a == b).all() if exact else torch.isclose(a, b, rtol=1e-5, atol=1e-5).all())


def _what_is(piece, pieces_of, op, exact):
    """(j, ranks) when `piece` is chunk j reduced over exactly those ranks (all of them first), else None.
    pieces_of[j][r]: rank r's input chunk j."""
    n = len(pieces_of[0])
    for size in range(n, 0, -1):
        for j, pieces in enumerate(pieces_of):
            for ranks in itertools.combinations(range(n), size):
                if _same(piece, REDUCE[op]([pieces[r] for r in ranks]), exact):
                    return j, ranks
    return None


LECTURE = ("the lecture's convention ends the reduce-scatter with the finished chunk r+1 on rank r; here rank r "
           "must end with chunk r: at step s send chunk (r - s - 1) mod N and combine the chunk (r - s - 2) mod N "
           "that arrives (README, 'The ring')")


def explain_chunks(xs, op, exact, positions, me) -> str | None:
    """What the parts of a result hold where they are wrong, when every part is recognisable, and the likely
    cause. positions: {chunk index the part should hold: the part}; me: this rank's place in the ring."""
    n = len(xs)
    pieces_of = [[x.tensor_split(n)[j] for x in xs] for j in range(n)]
    wrong = []  # (k, j, ranks): the part for chunk k holds chunk j reduced over those ranks
    for k, piece in positions.items():
        found = _what_is(piece, pieces_of, op, exact) if piece.numel() else (k, tuple(range(n)))
        if found is None:
            return None
        if found != (k, tuple(range(n))):
            wrong.append((k, *found))
    if not wrong:
        return None
    said = [f"chunk {k} holds the finished chunk {j}" if len(ranks) == n and j != k else
            f"chunk {k} holds chunk {j} reduced over ranks {list(ranks)} only" if j != k else
            f"chunk {k} is reduced over ranks {list(ranks)} only" for k, j, ranks in wrong]
    shifts = {(j - k) % n for k, j, _ in wrong}
    if all(j == k and ranks in ((k,), (me,)) for k, j, ranks in wrong):
        cause = (f"{'each chunk k holds only rank k' if len(positions) > 1 else 'it holds only this rank'}'s own "
                 "input: the reduce-scatter did not leave rank r with the finished chunk r. Either it is a step "
                 f"short, or {LECTURE}")
    elif shifts == {1}:
        cause = f"every chunk is shifted by one: {LECTURE}"
    elif 0 not in shifts:
        cause = (f"the chunk indices are off by {sorted(shifts)}: write down, for N = 3, which chunk each rank sends "
                 "and receives at each step (README, 'The ring')")
    else:
        cause = "a received chunk was not combined into yours, or a ring step is missing"
    return "; ".join(said) + ". Likely: " + cause + "."


def expect_reduced(ctx, xs, op, exact, what, positions, me) -> None:
    """Before ctx.expect: a recognisable mistake is named rather than shown as numbers."""
    n = len(xs)
    if not all(_same(part, REDUCE[op]([x.tensor_split(n)[k] for x in xs]), exact) for k, part in positions.items()):
        explained = explain_chunks(xs, op, exact, positions, me)
        if explained:
            ctx.fail(f"{what}: rank {ctx.rank}: {explained}")


def check_all_reduce(student, ctx, numel, dtype=torch.float32, op=SUM, group=None, seed=0):
    group = group if group is not None else ctx.group
    members = dist.get_process_group_ranks(group)
    xs = inputs(len(members), numel, dtype, op, seed)
    mine = xs[members.index(ctx.rank)].clone()
    student.all_reduce(mine, op, group, False)
    exact = op in (MAX, MIN) or not dtype.is_floating_point
    what = f"all_reduce {NAMES[op]} of {numel} {str(dtype)[6:]} elements (ring of global ranks {members})"
    if mine.shape == xs[0].shape and len(members) > 1:
        expect_reduced(ctx, xs, op, exact, what, dict(enumerate(mine.tensor_split(len(members)))),
                       members.index(ctx.rank))
    ctx.expect(mine, REDUCE[op](xs), what, exact=exact)


@check("all-gather: every rank ends with every rank's chunk, in rank order", points=2, world_sizes=(3, 4))
def all_gather(student, ctx):
    n = ctx.world_size
    for rows in (1, 5):
        xs = [x.view(rows, 3) for x in inputs(n, rows * 3, seed=1)]
        output = torch.full((n * rows, 3), float("nan"))
        student.all_gather(output, xs[ctx.rank], ctx.group, False)
        blocks = output.split(rows)
        misplaced = [(k, j) for k, block in enumerate(blocks) for j, x in enumerate(xs)
                     if j != k and _same(block, x, True)]
        unwritten = [k for k, block in enumerate(blocks) if bool(block.isnan().all())]
        if misplaced or unwritten:
            shifts = {(j - k) % n for k, j in misplaced}
            ctx.fail(f"all_gather of {rows}x3 float32 inputs: rank {ctx.rank}: " + "; ".join(
                [f"block {k} holds rank {j}'s input" for k, j in misplaced]
                + ([f"blocks {unwritten} were never written (still the NaN the grader filled in)"] if unwritten else []))
                + ". Block k must hold rank k's input: at step 0 each rank sends its own block (chunk r), then "
                "forwards the one it just received" + (f" (the blocks are shifted by {shifts.pop()})" if len(shifts) == 1
                                                         else ""))
        ctx.expect(output, torch.cat(xs), f"all_gather of {rows}x3 float32 inputs")


@check("reduce-scatter, SUM: rank r ends with the sum of everyone's chunk r", points=2, world_sizes=(3, 4))
def reduce_scatter(student, ctx):
    n = ctx.world_size
    for chunk in (1, 6):
        xs = inputs(n, n * chunk, seed=2)
        mine, before = xs[ctx.rank].clone(), xs[ctx.rank].clone()
        output = torch.full((chunk,), float("nan"))
        student.reduce_scatter(output, mine, SUM, ctx.group, False)
        expected = torch.stack(xs).sum(0).tensor_split(n)[ctx.rank]
        what = f"reduce_scatter SUM of {n}x{chunk} float32 elements"
        expect_reduced(ctx, xs, SUM, False, what, {ctx.rank: output}, ctx.rank)
        ctx.expect(output, expected, what, exact=False)
        ctx.expect(mine, before, "reduce_scatter must leave its input unchanged; input after the call")


@check("all-reduce, SUM, float32, size divisible by N", points=2, world_sizes=(3, 4))
def all_reduce_sum(student, ctx):
    check_all_reduce(student, ctx, 12 * ctx.world_size)


@check("all-reduce, sizes not divisible by N (1, 5, 7, 129 elements)", points=2, world_sizes=(3, 4))
def all_reduce_uneven(student, ctx):
    for numel in (1, 5, 7, 129):
        check_all_reduce(student, ctx, numel, seed=3)


@check("all-reduce with MAX, MIN and PRODUCT, in float64 and int64", points=1, world_sizes=(3,))
def all_reduce_ops_and_dtypes(student, ctx):
    for dtype in (torch.float64, torch.int64):
        for op in (MAX, MIN, PRODUCT, SUM):
            check_all_reduce(student, ctx, 10, dtype, op, seed=4)


@check("a real ring: only neighbours talk, each rank sends 2(N-1)/N of the tensor, no built-in collective",
       points=2, world_sizes=(3, 4))
def ring_traffic(student, ctx):
    n, numel = ctx.world_size, 25 * ctx.world_size
    with ctx.messages() as messages:
        check_all_reduce(student, ctx, numel, seed=5)
    right, left = (ctx.rank + 1) % n, (ctx.rank - 1) % n
    sent = sum(m.numel for m in messages if m.kind == "send")
    wrong_way = sorted({(m.kind, m.peer) for m in messages
                        if (m.kind, m.peer) not in (("send", right), ("recv", left))})
    if wrong_way:
        ctx.fail(f"rank {ctx.rank} (left neighbour {left}, right neighbour {right}) also posted "
                 f"{', '.join(f'a {k} with rank {p}' for k, p in wrong_way)}: in a ring a rank sends only "
                 "to its right neighbour and receives only from its left one")
    if sent != 2 * (n - 1) * numel // n:
        ctx.fail(f"all_reduce of {numel} elements: rank {ctx.rank} sent {sent} elements; a ring sends "
                 f"2(N-1)/N x {numel} = {2 * (n - 1) * numel // n} (N-1 chunks of {numel // n} in the "
                 "reduce-scatter, N-1 in the all-gather)")


@check("rings on subgroups: global ranks {0, 2} and {1, 3}, and a ring of one", points=1, world_sizes=(4,))
def subgroups(student, ctx):
    pair, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    alone, _ = dist.new_subgroups_by_enumeration([[r] for r in range(ctx.world_size)])
    check_all_reduce(student, ctx, 7, group=pair, seed=6)
    check_all_reduce(student, ctx, 7, group=alone, seed=7)


@check("plugs into toolkit.comm: comm.use({...}) routes the toolkit's collectives to your functions",
       points=1, world_sizes=(3,))
def through_the_door(student, ctx):
    from toolkit.trace.events import recorder

    n = ctx.world_size
    xs = inputs(n, 9, seed=8)
    mine = xs[ctx.rank].clone()
    toolkit.comm.use({"all_reduce": student.all_reduce, "reduce_scatter": student.reduce_scatter,
                      "all_gather": student.all_gather})
    try:
        toolkit.comm.all_reduce(mine, op="avg", group=ctx.group)
    finally:
        toolkit.comm.use("backend")
    ctx.expect(mine, torch.stack(xs).mean(0), "toolkit.comm.all_reduce(op='avg') of 9 float32 elements", exact=False)
    if recorder.events[-1]["args"]["impl"] != "custom":
        ctx.fail(f"the trace says impl={recorder.events[-1]['args']['impl']!r}, expected 'custom'")
