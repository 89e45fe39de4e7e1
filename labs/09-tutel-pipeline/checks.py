"""The graded checks of lab 09 (Tutel's pipelined all-to-all), judged in the grader's process. Every check
runs on 2 ranks.

Each rank holds E_LOCAL experts (global expert g lives on rank g // E_LOCAL) and sends, for every one of the
E = 2·E_LOCAL experts, C = 5 capacity slots of d = 8 features: x is (E, C, d). The grader draws every rank's
input and every expert's weights for this grading and sends each rank its own; here one process with every
expert computes the right outputs and gradients (the reference), so the messages say exactly what differs.
"""

import torch

from toolkit.grading import Fields, List, Maybe, Tensor, check, like

ANSWERS = {
    "toolkit.moe.pipeline": "the toolkit's own pipelined all-to-all",
    "toolkit.moe.units:run_units": "the toolkit's own chunk k+1 posted before chunk k computes",
}
E_LOCAL, CAPACITY, D_MODEL, HIDDEN = 2, 5, 8, 16


def drawn(n, g, **extra) -> list:
    """Every expert's weights, each rank's tokens and output gradient (a fixed random probe); rank r gets its
    experts' weights only."""
    e = n * E_LOCAL
    w1 = (torch.randn(e, D_MODEL, HIDDEN, generator=g, dtype=torch.float64) / D_MODEL**0.5).float()
    w2 = (torch.randn(e, HIDDEN, D_MODEL, generator=g, dtype=torch.float64) / HIDDEN**0.5).float()
    mine = [slice(r * E_LOCAL, (r + 1) * E_LOCAL) for r in range(n)]
    return [
        dict(
            extra,
            w1=w1[mine[r]],
            w2=w2[mine[r]],
            x=torch.randn(e, CAPACITY, D_MODEL, generator=g),
            probe=torch.randn(e, CAPACITY, D_MODEL, generator=g),
        )
        for r in range(n)
    ]


def pipeline_inputs(*degrees):
    """One case per degree, each with its own tokens and weights."""
    return lambda n, g: {f"degree {d}": drawn(n, g, degree=d) for d in degrees}


EVENT = Fields({"name": str, "cat": str, "start": Maybe(float), "end": Maybe(float), "args": Fields({}, extra=True)})


def ran(case, r, n, backward=False):
    """What `run` returns: the output (and the gradients), the trace's events."""
    found = {"out": like(case["x"]), "events": [EVENT]}
    if backward:
        found.update(x_grad=Maybe(like(case["x"])), w1_grad=Maybe(like(case["w1"])), w2_grad=Maybe(like(case["w2"])))
    return found


def ran_backward(case, r, n):
    return ran(case, r, n, backward=True)


def reference(given):
    """One process, every expert: each rank's outputs and input gradients, and every expert's weight gradients."""
    w1 = torch.cat([g["w1"] for g in given]).requires_grad_(True)
    w2 = torch.cat([g["w2"] for g in given]).requires_grad_(True)
    xs = [g["x"].clone().requires_grad_(True) for g in given]
    outs = [torch.einsum("ech,ehi->eci", torch.relu(torch.einsum("eci,eih->ech", x, w1)), w2) for x in xs]
    sum((o * g["probe"]).sum() for o, g in zip(outs, given)).backward()
    return [o.detach() for o in outs], [x.grad for x in xs], w1.grad, w2.grad


SPLITS = {1: [5], 2: [3, 2], 3: [2, 2, 1], 5: [1] * 5, 8: [1] * 5}


def _split_returned(case, r, n):
    if case["degree"] == 0:
        return {"raised": str}
    return {
        "chunks": List(
            Tensor((2, None, 3), torch.float32), why="split_capacity returns a list of chunks of x, each (E, c, d)"
        )
    }


@check(
    "split_capacity: chunks along the capacity, sizes differing by at most one, no empty chunk",
    points=1,
    world_sizes=(2,),
    pure=True,
    cases={f"degree {d}": {"degree": d} for d in [*SPLITS, 0]},
    returns=_split_returned,
)
def split(ctx, given, got):
    x = torch.arange(2 * 5 * 3.0).view(2, 5, 3)
    degree = given[0]["degree"]
    if degree == 0:
        if got[0]["raised"] != "ValueError":
            ctx.fail("split_capacity(x, 0) must raise ValueError: a degree is at least 1")
        return
    sizes = SPLITS[degree]
    chunks = got[0]["chunks"]
    shapes = [c.shape[1] for c in chunks]
    if shapes != sizes:
        hint = (
            f": {len(shapes)} chunks for a degree of {degree}. Cutting chunks of capacity // degree slots "
            "leaves a remainder chunk; cut the capacity into `degree` chunks (at most one per slot) whose "
            "sizes differ by at most one"
            if len(shapes) > min(degree, 5)
            else ""
        )
        ctx.fail(
            f"split_capacity(x of capacity 5, degree {degree}) made chunks of {shapes} slots, expected {sizes}{hint}"
        )
    ctx.expect(torch.cat(chunks, dim=1), x, f"the chunks of degree {degree} put back together")


@check(
    "outputs: degrees 1, 2 and 3 give every rank the one-process layer's outputs",
    points=2,
    world_sizes=(2,),
    cases=pipeline_inputs(1, 2, 3),
    returns=ran,
)
def outputs(ctx, given, got):
    expected = reference(given)[0]
    for r in range(ctx.world_size):
        ctx.expect(
            got[r]["out"],
            expected[r],
            f"rank {r}'s outputs at pipeline degree {given[r]['degree']}",
            rank=r,
            exact=False,
        )


def judge_gradients(ctx, given, got):
    outs, grads_x, g1, g2 = reference(given)
    for r in range(ctx.world_size):
        mine = slice(r * E_LOCAL, (r + 1) * E_LOCAL)
        degree, found = given[r]["degree"], got[r]
        ctx.expect(found["out"], outs[r], f"rank {r}'s outputs at degree {degree}", rank=r, exact=False)
        ctx.expect(found["x_grad"], grads_x[r], f"rank {r}'s input gradient at degree {degree}", rank=r, exact=False)
        ctx.expect(
            found["w1_grad"],
            g1[mine],
            f"the gradient of rank {r}'s experts' w1 at degree {degree}",
            rank=r,
            exact=False,
        )
        ctx.expect(
            found["w2_grad"],
            g2[mine],
            f"the gradient of rank {r}'s experts' w2 at degree {degree}",
            rank=r,
            exact=False,
        )


@check(
    "gradients: the inputs' and the experts' gradients at degrees 2 and 3 equal the one-process layer's",
    points=2,
    world_sizes=(2,),
    cases=pipeline_inputs(2, 3),
    returns=ran_backward,
)
def gradients(ctx, given, got):
    judge_gradients(ctx, given, got)


def _order(ctx, r, events, backward: bool):
    """Check, forward or backward, that chunk k+1 travels while chunk k computes."""
    out_name, back_name = ("combine backward", "dispatch backward") if backward else ("dispatch", "combine")
    labels = [
        e["args"].get("moe")
        for e in events
        if e["cat"] == "comm" and str(e["args"].get("moe", "")).startswith((out_name + " chunk", back_name + " chunk"))
    ]
    comm = {e["args"].get("moe"): e for e in events if e["cat"] == "comm"}
    experts = {
        e["args"]["chunk"]: e
        for e in events
        if str(e["name"]).startswith("experts chunk") and bool(e["args"].get("backward")) == backward
    }
    count = len(experts)
    where = "backward" if backward else "forward"
    if count != 3:
        ctx.fail(f"rank {r}: at degree 3 the {where} computed {count} chunks, expected 3")
    expected = sorted(f"{name} chunk {k + 1}/{count}" for name in (out_name, back_name) for k in range(count))
    if sorted(labels) != expected:
        ctx.fail(
            f"rank {r} ({where}): the trace's exchanges are labelled {sorted(labels)}; expected each chunk's "
            f"{out_name} and {back_name} once, {expected}: exchange chunk k with k and its own name"
        )
    for k in range(count - 1):
        nxt = comm.get(f"{out_name} chunk {k + 2}/{count}")
        done = comm.get(f"{back_name} chunk {k + 1}/{count}")
        if nxt is None or done is None:
            ctx.fail(
                f"rank {r}: the {where} trace lacks '{out_name} chunk {k + 2}/{count}' or "
                f"'{back_name} chunk {k + 1}/{count}': exchange every chunk once each way"
            )
        if nxt["start"] > experts[k]["start"]:
            ctx.fail(
                f"rank {r} ({where}): chunk {k + 2}'s {out_name} was posted after chunk {k + 1}'s experts "
                f"had started, so it could not travel while they computed: post chunk k+1's {out_name} "
                "before computing chunk k"
            )
        if nxt["args"].get("waited_at", float("inf")) < experts[k]["end"]:
            ctx.fail(
                f"rank {r} ({where}): chunk {k + 2}'s {out_name} was waited for before chunk {k + 1}'s "
                "experts had finished: wait for a chunk only when its experts need it"
            )
        if done["start"] > experts[k + 1]["start"]:
            ctx.fail(
                f"rank {r} ({where}): chunk {k + 1}'s {back_name} was posted after chunk {k + 2}'s "
                f"experts had started: post each chunk's {back_name} as soon as its experts are done"
            )


@check(
    "overlap on the trace: chunk k+1's exchange is posted before chunk k computes, forward and backward",
    points=2,
    world_sizes=(2,),
    task="gradients",
    inputs=lambda n, g: drawn(n, g, degree=3),
    returns=ran_backward,
)
def overlap(ctx, given, got):
    for r in range(ctx.world_size):
        events = got[r]["events"]
        _order(ctx, r, events, backward=False)
        _order(ctx, r, events, backward=True)


TRAFFIC = (1, 3)


@check(
    "traffic: degree d sends 2d all-to-alls per forward and exactly the bytes of the plain layer",
    points=1,
    world_sizes=(2,),
    inputs=lambda n, g: drawn(n, g, degrees=TRAFFIC),
    returns=lambda case, r, n: {f"degree {d}": ran(case, r, n) for d in TRAFFIC},
)
def traffic(ctx, given, got):
    for r in range(ctx.world_size):
        sent = {}
        for degree in TRAFFIC:
            calls = [e for e in got[r][f"degree {degree}"]["events"] if e["cat"] == "comm"]
            if len(calls) != 2 * degree or any(e["name"] != "all_to_all" for e in calls):
                ctx.fail(
                    f"rank {r}: a forward at degree {degree} issued {[e['name'] for e in calls]}; expected "
                    f"{2 * degree} all-to-alls (a dispatch and a combine per chunk)"
                )
            sent[degree] = sum(e["args"]["bytes_sent"] for e in calls)
        if sent[3] != sent[1]:
            ctx.fail(
                f"rank {r}: degree 3 sent {sent[3]} bytes, degree 1 {sent[1]}: pipelining cuts the same rows "
                "into more messages, it must not send more or fewer of them"
            )
