"""The graded checks of lab 01 (ring all-reduce). Each runs on every rank of a real job.

Every rank builds every rank's input from the same seed, so each can compute the right answer on its
own and say exactly what differs ("all_reduce SUM of 7 float32 elements: rank 1 got [...] expected [...]").
"""
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


def check_all_reduce(student, ctx, numel, dtype=torch.float32, op=SUM, group=None, seed=0):
    group = group if group is not None else ctx.group
    members = dist.get_process_group_ranks(group)
    xs = inputs(len(members), numel, dtype, op, seed)
    mine = xs[members.index(ctx.rank)].clone()
    student.all_reduce(mine, op, group, False)
    exact = op in (MAX, MIN) or not dtype.is_floating_point
    ctx.expect(mine, REDUCE[op](xs), f"all_reduce {NAMES[op]} of {numel} {str(dtype)[6:]} elements "
                                     f"(ring of global ranks {members})", exact=exact)


@check("all-gather: every rank ends with every rank's chunk, in rank order", points=2, world_sizes=(3, 4))
def all_gather(student, ctx):
    n = ctx.world_size
    for rows in (1, 5):
        xs = [x.view(rows, 3) for x in inputs(n, rows * 3, seed=1)]
        output = torch.full((n * rows, 3), float("nan"))
        student.all_gather(output, xs[ctx.rank], ctx.group, False)
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
        ctx.expect(output, expected, f"reduce_scatter SUM of {n}x{chunk} float32 elements", exact=False)
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
