"""The graded checks of lab 01 (ring all-reduce), judged in the grader's process.

The grader draws every rank's input, sends rank r only its own (tasks.py runs your functions on it), and
computes the right answer from all of them here. When the numbers are a recognisable mistake, it says
which instead of showing floats: a chunk that holds another chunk's finished reduction (the ring's indices
shifted; the lecture's convention, where rank r ends with chunk r+1, is the commonest), a chunk reduced
over only some ranks (a step missing, or a received chunk not combined), or an all-gather block that
holds another rank's input.
"""

import itertools

import torch

from toolkit.grading import Either, Items, List, Tensor, check, like

ANSWERS = {"toolkit.comm.ring": "the toolkit's own ring collectives"}
MESSAGES_ONLY = True  # the ranks have no built-in collective: the grader's relay carries (and records) every message
REDUCE = {
    "SUM": lambda xs: torch.stack(xs).sum(0),
    "PRODUCT": lambda xs: torch.stack(xs).prod(0),
    "MAX": lambda xs: torch.stack(xs).amax(0),
    "MIN": lambda xs: torch.stack(xs).amin(0),
}
SUM = "SUM"


def draw(g, numel, dtype=torch.float32, op=SUM):
    """One rank's input; products use small values so nothing overflows."""
    if op == "PRODUCT":
        signs = 2 * torch.randint(0, 2, (numel,), generator=g) - 1
        return (torch.randint(1, 3, (numel,), generator=g) * signs).to(dtype)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-100, 100, (numel,), generator=g).to(dtype)


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


LECTURE = (
    "the lecture's convention ends the reduce-scatter with the finished chunk r+1 on rank r; here rank r "
    "must end with chunk r: at step s send chunk (r - s - 1) mod N and combine the chunk (r - s - 2) mod N "
    "that arrives (README, 'The ring')"
)


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
    said = [
        f"chunk {k} holds the finished chunk {j}"
        if len(ranks) == n and j != k
        else f"chunk {k} holds chunk {j} reduced over ranks {list(ranks)} only"
        if j != k
        else f"chunk {k} is reduced over ranks {list(ranks)} only"
        for k, j, ranks in wrong
    ]
    shifts = {(j - k) % n for k, j, _ in wrong}
    if all(j == k and ranks in ((k,), (me,)) for k, j, ranks in wrong):
        cause = (
            f"{'each chunk k holds only rank k' if len(positions) > 1 else 'it holds only this rank'}'s own "
            "input: the reduce-scatter did not leave rank r with the finished chunk r. Either it is a step "
            f"short, or {LECTURE}"
        )
    elif shifts == {1}:
        cause = f"every chunk is shifted by one: {LECTURE}"
    elif 0 not in shifts:
        cause = (
            f"the chunk indices are off by {sorted(shifts)}: write down, for N = 3, which chunk each rank sends "
            "and receives at each step (README, 'The ring')"
        )
    else:
        cause = "a received chunk was not combined into yours, or a ring step is missing"
    return "; ".join(said) + ". Likely: " + cause + "."


def expect_reduced(ctx, xs, op, exact, what, positions, me, rank) -> None:
    """Before ctx.expect: a recognisable mistake is named rather than shown as numbers."""
    n = len(xs)
    if not all(_same(part, REDUCE[op]([x.tensor_split(n)[k] for x in xs]), exact) for k, part in positions.items()):
        explained = explain_chunks(xs, op, exact, positions, me)
        if explained:
            ctx.fail(f"{what}: rank {rank}: {explained}")


def judge_all_reduce(ctx, xs, got, op, rank, members):
    """Rank `rank`'s all-reduce result `got` of the inputs `xs` of the ring `members` (global ranks)."""
    exact = op in ("MAX", "MIN") or not xs[0].dtype.is_floating_point
    what = f"all_reduce {op} of {xs[0].numel()} {str(xs[0].dtype)[6:]} elements (ring of global ranks {members})"
    got = ctx.tensor(got, what, rank)
    if got.shape == xs[0].shape and got.dtype == xs[0].dtype and len(members) > 1:
        expect_reduced(
            ctx, xs, op, exact, what, dict(enumerate(got.tensor_split(len(members)))), members.index(rank), rank
        )
    ctx.expect(got, REDUCE[op](xs), what, rank=rank, exact=exact)


def judge_all_reduce_case(ctx, given, got):
    xs = [given[r]["x"] for r in range(ctx.world_size)]
    for r in range(ctx.world_size):
        judge_all_reduce(ctx, xs, got[r]["x"], given[0]["op"], r, list(range(ctx.world_size)))


def cases(*specs):
    """All-reduce cases: (numel or a function of n, dtype, op) each; every rank draws its own input."""

    def make(n, g):
        found = {}
        for numel, dtype, op in specs:
            size = numel(n) if callable(numel) else numel
            found[f"{op}, {size} {str(dtype)[6:]} elements"] = [
                {"x": draw(g, size, dtype, op), "op": op} for _ in range(n)
            ]
        return found

    return make


def same_as_input(case, r, n):
    return {"x": like(case["x"])}


# --- the checks ----------------------------------------------------------------------------------------
def _gather_inputs(n, g):
    return {f"{rows}x3 per rank": [{"x": draw(g, rows * 3).view(rows, 3)} for _ in range(n)] for rows in (1, 5)}


@check(
    "all-gather: every rank ends with every rank's chunk, in rank order",
    points=2,
    world_sizes=(3, 4),
    cases=_gather_inputs,
    returns=lambda case, r, n: {"output": Tensor((n * case["x"].shape[0], 3), torch.float32)},
)
def all_gather(ctx, given, got):
    n = ctx.world_size
    xs = [given[r]["x"] for r in range(n)]
    rows = xs[0].shape[0]
    for r in range(n):
        output = got[r]["output"]
        blocks = output.split(rows)
        misplaced = [
            (b, j) for b, block in enumerate(blocks) for j, x in enumerate(xs) if j != b and _same(block, x, True)
        ]
        unwritten = [b for b, block in enumerate(blocks) if bool(block.isnan().all())]
        if misplaced or unwritten:
            shifts = {(j - b) % n for b, j in misplaced}
            ctx.fail(
                f"all_gather of {rows}x3 float32 inputs: rank {r}: "
                + "; ".join(
                    [f"block {b} holds rank {j}'s input" for b, j in misplaced]
                    + (
                        [f"blocks {unwritten} were never written (still the NaN the grader filled in)"]
                        if unwritten
                        else []
                    )
                )
                + ". Block k must hold rank k's input: at step 0 each rank sends its own block (chunk r), then "
                "forwards the one it just received"
                + (f" (the blocks are shifted by {shifts.pop()})" if len(shifts) == 1 else "")
            )
        ctx.expect(output, torch.cat(xs), f"all_gather of {rows}x3 float32 inputs", rank=r)


def _scatter_inputs(n, g):
    return {f"{n}x{chunk} elements": [{"x": draw(g, n * chunk)} for _ in range(n)] for chunk in (1, 6)}


@check(
    "reduce-scatter, SUM: rank r ends with the sum of everyone's chunk r",
    points=2,
    world_sizes=(3, 4),
    cases=_scatter_inputs,
    returns=lambda case, r, n: {
        "output": Tensor((case["x"].numel() // n,), torch.float32),
        "input_after": like(case["x"]),
    },
)
def reduce_scatter(ctx, given, got):
    n = ctx.world_size
    xs = [given[r]["x"] for r in range(n)]
    what = f"reduce_scatter SUM of {n}x{xs[0].numel() // n} float32 elements"
    for r in range(n):
        output = got[r]["output"]
        expect_reduced(ctx, xs, SUM, False, what, {r: output}, r, r)
        ctx.expect(output, torch.stack(xs).sum(0).tensor_split(n)[r], what, rank=r, exact=False)
        ctx.expect(
            got[r]["input_after"], xs[r], "reduce_scatter must leave its input unchanged; input after the call", rank=r
        )


@check(
    "all-reduce, SUM, float32, size divisible by N",
    points=2,
    world_sizes=(3, 4),
    task="all_reduce",
    cases=cases((lambda n: 12 * n, torch.float32, SUM)),
    returns=same_as_input,
)
def all_reduce_sum(ctx, given, got):
    judge_all_reduce_case(ctx, given, got)


@check(
    "all-reduce, sizes not divisible by N (1, 5, 7, 129 elements)",
    points=2,
    world_sizes=(3, 4),
    task="all_reduce",
    cases=cases(*[(numel, torch.float32, SUM) for numel in (1, 5, 7, 129)]),
    returns=same_as_input,
)
def all_reduce_uneven(ctx, given, got):
    judge_all_reduce_case(ctx, given, got)


@check(
    "all-reduce with MAX, MIN and PRODUCT, in float64 and int64",
    points=1,
    world_sizes=(3,),
    task="all_reduce",
    cases=cases(*[(10, dtype, op) for dtype in (torch.float64, torch.int64) for op in ("MAX", "MIN", "PRODUCT", SUM)]),
    returns=same_as_input,
)
def all_reduce_ops_and_dtypes(ctx, given, got):
    judge_all_reduce_case(ctx, given, got)


MESSAGE = Items(str, Either(int, str), int)  # ("send" | "recv", peer, elements), or ("collective", its name, 0)


@check(
    "a real ring: only neighbours talk, each rank sends 2(N-1)/N of the tensor, no built-in collective",
    points=2,
    world_sizes=(3, 4),
    inputs=lambda n, g: [{"x": draw(g, 25 * n), "op": SUM} for _ in range(n)],
    returns=lambda case, r, n: {"x": like(case["x"]), "messages": List(MESSAGE)},
)
def ring_traffic(ctx, given, got):
    judge_all_reduce_case(ctx, given, got)
    n, numel = ctx.world_size, given[0]["x"].numel()
    for r in range(n):
        messages = [tuple(m) for m in got[r]["messages"]]
        right, left = (r + 1) % n, (r - 1) % n
        sent = sum(m[2] for m in messages if m[0] == "send")
        wrong_way = sorted(
            {(kind, peer) for kind, peer, _ in messages if (kind, peer) not in (("send", right), ("recv", left))}
        )
        if wrong_way:
            ctx.fail(
                f"rank {r} (left neighbour {left}, right neighbour {right}) also posted "
                f"{', '.join(f'a {k} with rank {p}' for k, p in wrong_way)}: in a ring a rank sends only "
                "to its right neighbour and receives only from its left one"
            )
        if sent != 2 * (n - 1) * numel // n:
            ctx.fail(
                f"all_reduce of {numel} elements: rank {r} sent {sent} elements; a ring sends "
                f"2(N-1)/N x {numel} = {2 * (n - 1) * numel // n} (N-1 chunks of {numel // n} in the "
                "reduce-scatter, N-1 in the all-gather)"
            )


PAIRS = [[0, 2], [1, 3]]


def _subgroup_inputs(n, g):
    pair = [draw(g, 7) for _ in range(n)]
    alone = [draw(g, 7) for _ in range(n)]
    return [{"pairs": PAIRS, "pair": {"x": pair[r], "op": SUM}, "alone": {"x": alone[r], "op": SUM}} for r in range(n)]


@check(
    "rings on subgroups: global ranks {0, 2} and {1, 3}, and a ring of one",
    points=1,
    world_sizes=(4,),
    inputs=_subgroup_inputs,
    returns=lambda case, r, n: {"pair": like(case["pair"]["x"]), "alone": like(case["alone"]["x"])},
)
def subgroups(ctx, given, got):
    for members in PAIRS:
        xs = [given[m]["pair"]["x"] for m in members]
        for r in members:
            judge_all_reduce(ctx, xs, got[r]["pair"], SUM, r, members)
    for r in range(ctx.world_size):
        judge_all_reduce(ctx, [given[r]["alone"]["x"]], got[r]["alone"], SUM, r, [r])


@check(
    "plugs into toolkit.comm: comm.use({...}) routes the toolkit's collectives to your functions",
    points=1,
    world_sizes=(3,),
    inputs=lambda n, g: [{"x": draw(g, 9)} for _ in range(n)],
    returns=lambda case, r, n: {"x": like(case["x"]), "impl": str},
)
def through_the_door(ctx, given, got):
    xs = [given[r]["x"] for r in range(ctx.world_size)]
    for r in range(ctx.world_size):
        ctx.expect(
            got[r]["x"],
            torch.stack(xs).mean(0),
            "toolkit.comm.all_reduce(op='avg') of 9 float32 elements",
            rank=r,
            exact=False,
        )
        if got[r]["impl"] != "custom":
            ctx.fail(f"rank {r}: the trace says impl={got[r]['impl']!r}, expected 'custom'")
