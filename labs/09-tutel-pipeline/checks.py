"""The graded checks of lab 09 (Tutel's pipelined all-to-all). Each runs on every rank of a 2-rank job.

Each rank holds E_LOCAL experts (global expert g lives on rank g // E_LOCAL) and sends, for every one of
the E = 2·E_LOCAL experts, C = 5 capacity slots of d = 8 features: x is (E, C, d). Every rank builds every
rank's input and every expert's weights from fixed seeds, so each can compute the right outputs and
gradients on its own (a one-process reference) and say exactly what differs.
"""
import zlib

import torch

from toolkit.grading import check
from toolkit.trace.events import recorder

E_LOCAL, CAPACITY, D_MODEL, HIDDEN = 2, 5, 8, 16


def generator(*keys):
    return torch.Generator().manual_seed(zlib.crc32(repr(keys).encode()))  # the same on every rank


def weights(world):
    """Every global expert's (w1, w2), the same on every rank."""
    e = world * E_LOCAL
    w1 = torch.randn(e, D_MODEL, HIDDEN, generator=generator("w1", world), dtype=torch.float64) / D_MODEL ** 0.5
    w2 = torch.randn(e, HIDDEN, D_MODEL, generator=generator("w2", world), dtype=torch.float64) / HIDDEN ** 0.5
    return w1.float(), w2.float()


def inputs(rank, world):
    return torch.randn(world * E_LOCAL, CAPACITY, D_MODEL, generator=generator("x", rank, world))


def probe(rank, world):  # a fixed random gradient for the outputs: loss = (out * probe).sum()
    return torch.randn(world * E_LOCAL, CAPACITY, D_MODEL, generator=generator("probe", rank, world))


def reference(world):
    """One process, every expert: each rank's outputs and input gradients, and every expert's weight gradients."""
    w1, w2 = (w.clone().requires_grad_(True) for w in weights(world))
    xs = [inputs(r, world).requires_grad_(True) for r in range(world)]
    outs = [torch.einsum("ech,ehi->eci", torch.relu(torch.einsum("eci,eih->ech", x, w1)), w2) for x in xs]
    sum((o * probe(r, world)).sum() for r, o in enumerate(outs)).backward()
    return [o.detach() for o in outs], [x.grad for x in xs], w1.grad, w2.grad


def run(student, ctx, degree, backward=False):
    """The student's pipeline on this rank: (output, input gradient, local experts' weight gradients)."""
    w1, w2 = weights(ctx.world_size)
    mine = slice(ctx.rank * E_LOCAL, (ctx.rank + 1) * E_LOCAL)
    experts = student.Experts(w1[mine], w2[mine])
    x = inputs(ctx.rank, ctx.world_size).requires_grad_(backward)
    out = student.pipelined_experts(x, degree, experts, ctx.group)
    if not backward:
        return out.detach(), None, None
    (out * probe(ctx.rank, ctx.world_size)).sum().backward()
    return out.detach(), x.grad, (experts.w1.grad, experts.w2.grad)


@check("split_capacity: chunks along the capacity, sizes differing by at most one, no empty chunk",
       points=1, world_sizes=(2,))
def split(student, ctx):
    x = torch.arange(2 * 5 * 3.0).view(2, 5, 3)
    for degree, sizes in ((1, [5]), (2, [3, 2]), (3, [2, 2, 1]), (5, [1] * 5), (8, [1] * 5)):
        chunks = student.split_capacity(x, degree)
        got = [c.shape[1] for c in chunks]
        if got != sizes:
            ctx.fail(f"split_capacity(x of capacity 5, degree {degree}) made chunks of {got} slots, expected {sizes}")
        ctx.expect(torch.cat(chunks, dim=1), x, f"the chunks of degree {degree} put back together")
    try:
        student.split_capacity(x, 0)
    except ValueError:
        pass
    else:
        ctx.fail("split_capacity(x, 0) must raise ValueError: a degree is at least 1")


@check("outputs: degrees 1, 2 and 3 give every rank the one-process layer's outputs", points=2, world_sizes=(2,))
def outputs(student, ctx):
    expected = reference(ctx.world_size)[0][ctx.rank]
    for degree in (1, 2, 3):
        out, _, _ = run(student, ctx, degree)
        ctx.expect(out, expected, f"rank {ctx.rank}'s outputs at pipeline degree {degree}", exact=False)


@check("gradients: the inputs' and the experts' gradients at degrees 2 and 3 equal the one-process layer's",
       points=2, world_sizes=(2,))
def gradients(student, ctx):
    _, grads_x, g1, g2 = reference(ctx.world_size)
    mine = slice(ctx.rank * E_LOCAL, (ctx.rank + 1) * E_LOCAL)
    for degree in (2, 3):
        _, gx, (w1, w2) = run(student, ctx, degree, backward=True)
        ctx.expect(gx, grads_x[ctx.rank], f"rank {ctx.rank}'s input gradient at degree {degree}", exact=False)
        ctx.expect(w1, g1[mine], f"the gradient of rank {ctx.rank}'s experts' w1 at degree {degree}", exact=False)
        ctx.expect(w2, g2[mine], f"the gradient of rank {ctx.rank}'s experts' w2 at degree {degree}", exact=False)


def _order(ctx, start, backward: bool):
    """Check, forward or backward, that chunk k+1 travels while chunk k computes."""
    out_name, back_name = ("combine backward", "dispatch backward") if backward else ("dispatch", "combine")
    events = recorder.events[start:]
    comm = {e["args"].get("moe"): e for e in events if e["cat"] == "comm"}
    experts = {e["args"]["chunk"]: e for e in events if e["name"].startswith("experts chunk")
               and bool(e["args"].get("backward")) == backward}
    count = len(experts)
    where = "backward" if backward else "forward"
    if count != 3:
        ctx.fail(f"rank {ctx.rank}: at degree 3 the {where} computed {count} chunks, expected 3")
    for k in range(count - 1):
        nxt = comm.get(f"{out_name} chunk {k + 2}/{count}")
        done = comm.get(f"{back_name} chunk {k + 1}/{count}")
        if nxt is None or done is None:
            ctx.fail(f"rank {ctx.rank}: the {where} trace lacks '{out_name} chunk {k + 2}/{count}' or "
                     f"'{back_name} chunk {k + 1}/{count}': exchange every chunk once each way")
        if nxt["start"] > experts[k]["start"]:
            ctx.fail(f"rank {ctx.rank} ({where}): chunk {k + 2}'s {out_name} was posted after chunk {k + 1}'s experts "
                     f"had started, so it could not travel while they computed: post chunk k+1's {out_name} "
                     "before computing chunk k")
        if nxt["args"].get("waited_at", float("inf")) < experts[k]["end"]:
            ctx.fail(f"rank {ctx.rank} ({where}): chunk {k + 2}'s {out_name} was waited for before chunk {k + 1}'s "
                     "experts had finished: wait for a chunk only when its experts need it")
        if done["start"] > experts[k + 1]["start"]:
            ctx.fail(f"rank {ctx.rank} ({where}): chunk {k + 1}'s {back_name} was posted after chunk {k + 2}'s "
                     f"experts had started: post each chunk's {back_name} as soon as its experts are done")


@check("overlap on the trace: chunk k+1's exchange is posted before chunk k computes, forward and backward",
       points=2, world_sizes=(2,))
def overlap(student, ctx):
    start = len(recorder.events)
    run(student, ctx, 3, backward=True)
    _order(ctx, start, backward=False)
    _order(ctx, start, backward=True)


@check("traffic: degree d sends 2d all-to-alls per forward and exactly the bytes of the plain layer",
       points=1, world_sizes=(2,))
def traffic(student, ctx):
    sent = {}
    for degree in (1, 3):
        start = len(recorder.events)
        run(student, ctx, degree)
        calls = [e for e in recorder.events[start:] if e["cat"] == "comm"]
        if len(calls) != 2 * degree or any(e["name"] != "all_to_all" for e in calls):
            ctx.fail(f"rank {ctx.rank}: a forward at degree {degree} issued {[e['name'] for e in calls]}; expected "
                     f"{2 * degree} all-to-alls (a dispatch and a combine per chunk)")
        sent[degree] = sum(e["args"]["bytes_sent"] for e in calls)
    if sent[3] != sent[1]:
        ctx.fail(f"rank {ctx.rank}: degree 3 sent {sent[3]} bytes, degree 1 {sent[1]}: pipelining cuts the same rows "
                 "into more messages, it must not send more or fewer of them")
