"""The graded checks of lab 07 (hybrid sharding). Each runs on every rank of a real job of 4 ranks,
seen as 2 nodes of 2 (F = 2): ranks 0 and 1 are node 0, ranks 2 and 3 node 1.

The student's `HybridUnit` is plugged into the toolkit's FSDP on the toolkit's tiny GPT (3 units: the
root with the tied embedding, and one per block). Every rank also keeps an unwrapped copy of the model
and trains it alone on the whole batch: the reference hybrid sharding must match.
"""
import copy
import functools

import torch
import torch.distributed as dist

from toolkit.grading import check
from toolkit.models import SyntheticCorpus, tiny_gpt
from toolkit.parallel.flat import FlatBuffer
from toolkit.trace.events import recorder

F = 2  # ranks per node = the sharding factor
GLOBAL_BATCH, STEPS, LR = 8, 3, 0.1
# SGD with momentum (as lab 03): Adam would hide a gradient N times too large, SGD shows it.
OPTIMIZER = functools.partial(torch.optim.SGD, lr=LR, momentum=0.9)
TOLERANCE = dict(rtol=1e-4, atol=1e-6)


def wrapped(student):
    torch.manual_seed(0)
    model = tiny_gpt()
    reference = copy.deepcopy(model)
    fsdp, opt = student.wrap(model, F, optimizer=OPTIMIZER)
    return fsdp, opt, reference


def batch(rank, world, step=0):
    return SyntheticCorpus().batch(step, GLOBAL_BATCH, rank=rank, world_size=world)


def node_batch(node, world, step=0):
    """The rows of every rank of one node: what a node sees when the replicas are never averaged."""
    rows = [batch(r, world, step) for r in range(node * F, (node + 1) * F)]
    return torch.cat([x for x, _ in rows]), torch.cat([y for _, y in rows])


def expected_slice(unit, grads: dict):
    flat = FlatBuffer(unit.flat.shapes, unit.flat.world_size)
    flat.copy_from([grads[name] for name in unit.param_names])
    return flat.shard(unit.sharding.rank)


@check("hsdp_layout: shard groups are nodes of F consecutive ranks, replica groups every F-th rank",
       points=1, world_sizes=(4,))
def layout(student, ctx):
    cases = {(4, 2): ([[0, 1], [2, 3]], [[0, 2], [1, 3]]),
             (8, 4): ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]]),
             (6, 3): ([[0, 1, 2], [3, 4, 5]], [[0, 3], [1, 4], [2, 5]]),
             (4, 4): ([[0, 1, 2, 3]], [[0], [1], [2], [3]]),   # full sharding: every replica group alone
             (4, 1): ([[0], [1], [2], [3]], [[0, 1, 2, 3]])}   # no sharding: plain data parallelism
    for (world, f), expected in cases.items():
        got = student.hsdp_layout(world, f)
        got = ([list(g) for g in got[0]], [list(g) for g in got[1]])
        if got != expected:
            ctx.fail(f"hsdp_layout({world}, {f}) returned {got}, expected {expected} (shard groups, replica groups)")


@check("make_groups: this rank's shard group is its node, its replica group the same slot in every node",
       points=1, world_sizes=(4,))
def groups(student, ctx):
    shard, replica = student.make_groups(F)
    node, slot = ctx.rank // F, ctx.rank % F
    for group, what, expected in ((shard, "shard group", [node * F + i for i in range(F)]),
                                  (replica, "replica group", list(range(slot, ctx.world_size, F)))):
        members = dist.get_process_group_ranks(group)
        if sorted(members) != expected:
            ctx.fail(f"rank {ctx.rank}: make_groups returned a {what} of ranks {members}, expected {expected}")
        value = torch.tensor([float(ctx.rank)])
        dist.all_reduce(value, group=group)
        ctx.expect(value, torch.tensor([float(sum(expected))]), f"an all-reduce over rank {ctx.rank}'s {what}")


@check("after one backward each rank holds its slice of the WHOLE batch's gradient: averaged inside the "
       "node, then across the nodes", points=2, world_sizes=(4,))
def gradient_slices(student, ctx):
    fsdp, _, reference = wrapped(student)
    fsdp(*batch(ctx.rank, ctx.world_size)).backward()
    whole, alone = copy.deepcopy(reference), reference
    whole(*batch(0, 1)).backward()
    alone(*node_batch(ctx.rank // F, ctx.world_size)).backward()
    grads = {n: p.grad for n, p in whole.named_parameters()}
    node_grads = {n: p.grad for n, p in alone.named_parameters()}
    for unit in fsdp.units:
        got = unit.mine.grad
        if got is None:
            ctx.fail(f"rank {ctx.rank}: unit {unit.name!r} has no gradient after backward: finish_reduce must "
                     "leave the reduced slice in self.mine.grad")
        expected = expected_slice(unit, grads)
        if not torch.allclose(got, expected, **TOLERANCE):
            if torch.allclose(got, expected_slice(unit, node_grads), **TOLERANCE):
                ctx.fail(f"rank {ctx.rank}: unit {unit.name!r}'s gradient is the average over node "
                         f"{ctx.rank // F}'s rows only: the replicas were never averaged, so each node would "
                         "train its own model. All-reduce the slice (op='avg') over the replica group")
            ratio = (got.double().norm() / expected.double().norm().clamp_min(1e-30)).item()
            for n, level in ((F, "inside the node (reduce-scatter)"), (ctx.world_size // F, "across the nodes "
                             "(all-reduce)"), (ctx.world_size, "at both levels")):
                if n > 1 and abs(ratio - n) < 0.05 * n:
                    ctx.fail(f"rank {ctx.rank}: unit {unit.name!r}'s gradient is {ratio:.2f}x the whole batch's: "
                             f"summed instead of averaged {level}; use op='avg'")
        ctx.expect(got, expected, f"rank {ctx.rank}'s gradient slice of unit {unit.name!r}", exact=False, **TOLERANCE)


@check(f"parity with one process: {STEPS} SGD steps give every rank the same parameters", points=2,
       world_sizes=(4,))
def parity(student, ctx):
    fsdp, opt, reference = wrapped(student)
    ref_opt = OPTIMIZER(reference.parameters())
    for step in range(STEPS):
        for net, optimizer, rank, world in ((fsdp, opt, ctx.rank, ctx.world_size), (reference, ref_opt, 0, 1)):
            net(*batch(rank, world, step)).backward()
            optimizer.step()
            optimizer.zero_grad()
    got = fsdp.full_state_dict()
    for name, p in reference.named_parameters():
        ctx.expect(got[name].detach().float(), p.detach(), f"{name!r} after {STEPS} SGD steps", exact=False,
                   rtol=1e-4, atol=1e-5)


@check("bytes across nodes: only the slices' all-reduce crosses, 2(R-1)/R x Ψ/F per rank per step; inside "
       "the node 3Ψ(F-1)/F", points=2, world_sizes=(4,))
def bytes_across_nodes(student, ctx):
    fsdp, opt, _ = wrapped(student)
    start = len(recorder.events)
    fsdp(*batch(ctx.rank, ctx.world_size)).backward()
    opt.step()
    events = [e for e in recorder.events[start:] if e["cat"] == "comm"]
    across = [e for e in events if len({r // F for r in e["args"]["group"]}) > 1]
    inside = [e for e in events if len({r // F for r in e["args"]["group"]}) == 1]
    replicas = ctx.world_size // F
    psi = sum(u.flat.padded_numel for u in fsdp.units)
    theory_across = sum(2 * (replicas - 1) * (u.flat.shard_numel * 4) // replicas for u in fsdp.units)
    theory_inside = 3 * psi * 4 * (F - 1) / F
    sent_across = sum(e["args"]["bytes_sent"] for e in across)
    sent_inside = sum(e["args"]["bytes_sent"] for e in inside)
    kinds = sorted({e["name"] for e in across})
    if not across:
        ctx.fail(f"rank {ctx.rank}: no byte crossed from node to node in a step: the replicas were never averaged "
                 "(an all-reduce of the slice over the replica group)")
    if kinds != ["all_reduce"] or abs(sent_across - theory_across) > len(across):
        ctx.fail(f"rank {ctx.rank}: {sent_across} bytes crossed nodes in a step, in {kinds}; hybrid sharding sends "
                 f"across nodes only the all-reduce of each unit's slice, 2(R-1)/R x Ψ/F x 4 = {theory_across} "
                 f"bytes (Ψ = {psi} padded elements, F = {F}, R = {replicas} nodes)")
    if abs(sent_inside - theory_inside) > len(inside):
        ctx.fail(f"rank {ctx.rank}: {sent_inside} bytes moved inside the node in a step; two all-gathers and one "
                 f"reduce-scatter per unit within the shard group are 3Ψ(F-1)/F x 4 = {theory_inside:.0f}")
