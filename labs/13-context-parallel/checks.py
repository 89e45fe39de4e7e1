"""The graded checks of lab 13 (ring attention's merge and pass), judged in the grader's process.

Every expected value is computed here by the definition of attention (softmax of the scores over the keys a query
sees, one process, float64), never by a merge or a ring: the merge's cases are scores and values drawn for this
grading, cut into two blocks; the rings' are a whole sequence's queries, keys and values, cut into one block per
rank. What the ranks did in order (messages posted and waited for, blocks attended) is their own record
(tasks.py); what they sent is the grader's relay's. When a result is wrong in a way this lab's classic mistakes
make, the message names the mistake instead of showing floats (`diagnose.py`).
"""

import torch

from toolkit.grading import Either, Items, List, check, like, sibling

ANSWERS = {
    "toolkit.parallel.context.merge:merge": "the toolkit's own online-softmax merge",
    "toolkit.parallel.context.merge:merge_into": "the toolkit's merge of a block into some rows",
    "toolkit.parallel.context.ring:Ring": "the toolkit's ring: neighbours, the block in hand, the pass",
    "toolkit.parallel.context.ring:Pass": "the toolkit's pass on its way (its wait)",
    "toolkit.parallel.context.ring_attention:RingAttention": "the toolkit's ring attention, forward and backward",
    "toolkit.parallel.context.ring_attention:ring_attention": "the toolkit's ring attention",
    "toolkit.parallel.context.ring_attention:part": "which part of a block a rank attends (the causal mask per block)",
}
MESSAGES_ONLY = True  # the ranks have no built-in collective: the grader's relay carries (and records) every message
DIAGNOSE = sibling(__file__, "diagnose.py")
BATCH, HEADS, HEAD_DIM = 1, 2, 4
SPREAD = 1.5  # queries' scale: sharper softmaxes, so a key seen or not moves an output by ~0.1, not 1e-3
# float64 throughout: a ring only reorders the sums of one softmax (~1e-15 apart); a key too many or too few moves an
# output by more than 1e-3, and 1e-9 sits a million times above the rounding and as far below any mistake.
ATOL = RTOL = 1e-9


# --- the merge -----------------------------------------------------------------------------------------------
def _merge_case(g, dtype, shift=0.0, apart=0.0, unseen=None):
    """Two blocks of scores (5 queries over 3 and 4 keys) and values; `shift` added to every score, `apart` to the
    second block's; unseen: (block, rows) whose scores are all -inf (those queries saw no key there)."""
    scores = [torch.randn(BATCH, HEADS, 5, keys, generator=g, dtype=torch.float64) * 2 + shift for keys in (3, 4)]
    scores[1] += apart
    if unseen is not None:
        scores[unseen[0]][:, :, unseen[1]] = float("-inf")
    values = [torch.randn(BATCH, HEADS, keys, HEAD_DIM, generator=g, dtype=torch.float64) for keys in (3, 4)]
    (out1, lse1), (out2, lse2) = (DIAGNOSE.softmax_attention(s, v) for s, v in zip(scores, values))
    case = {"out1": out1, "lse1": lse1, "out2": out2, "lse2": lse2}
    return {**{name: t.to(dtype) for name, t in case.items()}, "scores": scores, "values": values}


def merge_cases(n, g):
    huge = float(torch.randint(850, 950, (), generator=g))
    return {
        "float64": _merge_case(g, torch.float64),
        "float32": _merge_case(g, torch.float32),
        f"float64, scores near {huge:.0f} (e^{huge:.0f} overflows)": _merge_case(g, torch.float64, huge),
        "float32, scores near 100 (e^100 overflows)": _merge_case(g, torch.float32, 100.0),
        "float64, the second block 40 below the first": _merge_case(g, torch.float64, apart=-40.0),
        "float64, the second block saw no key (lse2 = -inf)": _merge_case(g, torch.float64, unseen=(1, slice(None))),
        "float64, the first block saw no key for queries 1 and 3": _merge_case(g, torch.float64, unseen=(0, [1, 3])),
    }


@check(
    "merge: two blocks' (out, lse) make attention over both, stable for large scores and for a block that saw no key",
    points=2,
    world_sizes=(2,),
    pure=True,
    cases=merge_cases,
    returns=lambda case, r, n: {"out": like(case["out1"]), "lse": like(case["lse1"])},
)
def merge(ctx, given, got):
    case = given[0]
    out, lse = DIAGNOSE.softmax_attention(torch.cat(case["scores"], -1), torch.cat(case["values"], -2))
    dtype = case["out1"].dtype
    tolerance = dict(rtol=RTOL, atol=ATOL) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    said = DIAGNOSE.merge_mistake(case, got[0], out.to(dtype), lse.to(dtype), tolerance)
    if said:
        ctx.fail(f"merge, {ctx.case}: {said}")
    ctx.expect(got[0]["out"], out.to(dtype), f"merge, {ctx.case}: out", exact=False, **tolerance)
    ctx.expect(got[0]["lse"], lse.to(dtype), f"merge, {ctx.case}: lse", exact=False, **tolerance)


# --- the rings -----------------------------------------------------------------------------------------------
def ring_inputs(g, members: list, causal: bool, length: int) -> list:
    """One whole sequence cut into a block of `length` tokens per member of the ring (global ranks, in ring order):
    each member's q, k, v, the output's gradient, and its rows of the whole attention's out and lse."""
    q, k, v, grad = (
        torch.randn(BATCH, HEADS, length * len(members), HEAD_DIM, generator=g, dtype=torch.float64) for _ in range(4)
    )
    q = q * SPREAD
    whole = DIAGNOSE.whole_attention(q, k, v, grad, causal)
    rows = [slice(p * length, (p + 1) * length) for p in range(len(members))]
    return [
        {
            "q": q[:, :, s],
            "k": k[:, :, s],
            "v": v[:, :, s],
            "grad": grad[:, :, s],
            "out": whole["out"][:, :, s],
            "lse": whole["lse"][:, :, s],
            "causal": causal,
        }
        for s in rows
    ]


def _length(g) -> int:
    return int(torch.randint(2, 6, (), generator=g))


def both_masks(n, g):
    length = _length(g)
    return {
        name: ring_inputs(g, list(range(n)), causal, length)
        for name, causal in (("causal", True), ("not causal", False))
    }


def ring_members(given, ring: list) -> dict:
    """The grader's copy of one ring's case, put back together: the whole sequence and its attention."""
    whole = {name: torch.cat([given[r][name] for r in ring], dim=2) for name in ("q", "k", "v", "grad")}
    causal = given[ring[0]]["causal"]
    return {
        **whole,
        **DIAGNOSE.whole_attention(whole["q"], whole["k"], whole["v"], whole["grad"], causal),
        "causal": causal,
        "ring": ring,
        "length": given[ring[0]]["q"].shape[2],
    }


def forwarded(case, r, n):
    return {"out": like(case["q"]), "lse": like(case["lse"])}


def backwarded(case, r, n):
    return {"dq": like(case["q"]), "dk": like(case["k"]), "dv": like(case["v"])}


def judge_forward(ctx, given, got, ring: list) -> None:
    whole = ring_members(given, ring)
    for p, r in enumerate(ring):
        rows, where = slice(p * whole["length"], (p + 1) * whole["length"]), f"{ctx.case}, rank {r}"
        right = [torch.allclose(got[r][name], whole[name][:, :, rows], rtol=RTOL, atol=ATOL) for name in ("out", "lse")]
        if not all(right):
            ctx.fail(DIAGNOSE.forward_mistake(whole, p, got[r]["out"], got[r]["lse"], where, ATOL))


def judge_backward(ctx, given, got, ring: list) -> None:
    whole = ring_members(given, ring)
    rows = [slice(p * whole["length"], (p + 1) * whole["length"]) for p in range(len(ring))]
    for p, r in enumerate(ring):  # dq first, on every rank: a wrong mask shows there as such
        if not torch.allclose(got[r]["dq"], whole["dq"][:, :, rows[p]], rtol=RTOL, atol=ATOL):
            ctx.fail(DIAGNOSE.dq_mistake(whole, p, got[r]["dq"], f"{ctx.case}, rank {r}", ATOL))
    for p, r in enumerate(ring):
        if not all(
            torch.allclose(got[r][name], whole[name][:, :, rows[p]], rtol=RTOL, atol=ATOL) for name in ("dk", "dv")
        ):
            ctx.fail(DIAGNOSE.dkv_mistake(whole, p, got[r]["dk"], got[r]["dv"], f"{ctx.case}, rank {r}", ATOL))


@check(
    "forward: every rank's out and lse equal attention over the whole sequence, causal and not, cp = 2, 3, 4",
    points=2,
    world_sizes=(2, 3, 4),
    cases=both_masks,
    returns=forwarded,
)
def forward(ctx, given, got):
    judge_forward(ctx, given, got, list(range(ctx.world_size)))


@check(
    "backward: every rank's dq, dk, dv equal the whole sequence's gradients, causal and not, cp = 2, 3, 4",
    points=2,
    world_sizes=(2, 3, 4),
    cases=both_masks,
    returns=backwarded,
)
def backward(ctx, given, got):
    judge_backward(ctx, given, got, list(range(ctx.world_size)))


# --- the traffic, and the order of events --------------------------------------------------------------------
MESSAGE = Items(str, int, int)  # ("send" | "recv", peer, elements): what the grader's relay carried


def one_sequence(causal: bool):
    return lambda n, g: ring_inputs(g, list(range(n)), causal, _length(g))


def judge_traffic(ctx, given, got, direction: str) -> None:
    n, block = ctx.world_size, 2 * given[0]["k"].numel()  # one block of K and V, in values
    for r in range(n):
        said = DIAGNOSE.traffic_mistake([tuple(m) for m in got[r]["messages"]], r, n, block, direction)
        if said:
            ctx.fail(said)


@check(
    "traffic, forward: only ring neighbours talk, each rank sends cp - 1 blocks of K and V",
    points=1,
    world_sizes=(2, 3, 4),
    task="traffic_forward",
    inputs=one_sequence(True),
    returns=lambda case, r, n: {"messages": List(MESSAGE)},
)
def traffic_forward(ctx, given, got):
    judge_traffic(ctx, given, got, "forward")


@check(
    "traffic, backward: only ring neighbours talk, each rank sends cp - 1 blocks of K and V and cp - 1 of their "
    "gradients",
    points=1,
    world_sizes=(2, 3, 4),
    task="traffic_backward",
    inputs=one_sequence(True),
    returns=lambda case, r, n: {"messages": List(MESSAGE)},
)
def traffic_backward(ctx, given, got):
    judge_traffic(ctx, given, got, "backward")


EVENT = Items(str, Either(int, str), int, why="tasks.py records (what, peer or index or direction, elements)")


@check(
    "overlap: each pass is posted before a block's attention and waited for after it, forward and backward",
    points=2,
    world_sizes=(2, 3, 4),
    inputs=one_sequence(False),
    returns=lambda case, r, n: {"events": List(EVENT)},
)
def overlap(ctx, given, got):
    for r in range(ctx.world_size):
        said = DIAGNOSE.overlap_mistake(got[r]["events"], r)
        if said:
            ctx.fail(said)


# --- rings of a subgroup, and of one -------------------------------------------------------------------------
GROUPS = [[0, 1, 3], [2]]  # a ring of three whose neighbours are not r ± 1, and a ring of one


def subgroup_inputs(n, g):
    length, found = _length(g), [None] * n
    for ring in GROUPS:
        for r, inputs in zip(ring, ring_inputs(g, ring, True, length)):
            found[r] = {**inputs, "groups": GROUPS}
    return found


@check(
    "rings on subgroups: global ranks 0, 1, 3 (causal), and a ring of one",
    points=1,
    world_sizes=(4,),
    inputs=subgroup_inputs,
    returns=lambda case, r, n: {**forwarded(case, r, n), **backwarded(case, r, n)},
)
def subgroups(ctx, given, got):
    for ring in GROUPS:
        judge_forward(ctx, given, got, ring)
        judge_backward(ctx, given, got, ring)
