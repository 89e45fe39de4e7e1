"""The graded checks of lab 07 (hybrid sharding), judged in the grader's process. Every check runs on 4 ranks,
seen as 2 nodes of 2 (F = 2): ranks 0 and 1 are node 0, ranks 2 and 3 node 1.

Each rank plugs your `HybridUnit` into the toolkit's FSDP on the toolkit's tiny GPT (3 units: the root with
the tied embedding, and one per block), built from a seed drawn for this grading, and trains on its own rows
(tasks.py). Here the same model trains alone on the whole batch: the reference hybrid sharding must match.
"""

import torch

from toolkit.grading import Fields, Items, List, Maybe, Tensor, check, like, model_labs
from toolkit.models import SyntheticCorpus
from toolkit.parallel.flat import FlatBuffer

ANSWERS = {
    "toolkit.parallel.fsdp_unit:sharding_groups": "the toolkit's own hybrid sharding groups",
    "toolkit.parallel.fsdp_unit:FSDPUnit.reduce_grad": "the toolkit's own gradient reduction",
    "toolkit.parallel.fsdp_unit:FSDPUnit.finish_reduce": "the toolkit's own gradient reduction",
    "toolkit.comm.hierarchical:node_groups": "the 2D all-to-all's node and cross-node groups, make_groups's",
}
BUILDS_ON = [
    "toolkit.parallel.fsdp_unit:sharding_groups",  # toolkit.parallel.wrap(sharding_group_size=) calls it
    "toolkit.parallel.fsdp_unit:FSDPUnit.unshard",
    "toolkit.parallel.fsdp_unit:FSDPUnit.wait_unshard",
    "toolkit.parallel.fsdp_unit:FSDPUnit.reshard",
    "toolkit.parallel.fsdp_unit:FSDPUnit.add_grad",
]
F = 2  # ranks per node = the sharding factor
GLOBAL_BATCH, STEPS, LR = 8, 3, 0.1
# SGD with momentum (as lab 03): Adam would hide a gradient N times too large, SGD shows it.
OPTIMIZER = dict(lr=LR, momentum=0.9)
TOLERANCE = dict(rtol=1e-4, atol=1e-6)


def batch(rank, world, step=0):
    return SyntheticCorpus().batch(step, GLOBAL_BATCH, rank=rank, world_size=world)


def training(steps):
    return model_labs.training(steps, GLOBAL_BATCH, OPTIMIZER)


def local(seed, steps, rows=None):
    """The reference: one process on the whole batch (or on `rows`); after `steps` SGD steps, or one backward."""
    return model_labs.local(seed, steps, GLOBAL_BATCH, torch.optim.SGD, OPTIMIZER, rows=rows)


def node_batch(node, world, step=0):
    """The rows of every rank of one node: what a node sees when the replicas are never averaged."""
    rows = [batch(r, world, step) for r in range(node * F, (node + 1) * F)]
    return torch.cat([x for x, _ in rows]), torch.cat([y for _, y in rows])


PARAMETERS = model_labs.parameters()
UNITS = model_labs.fsdp_units(F)  # FSDP's units, each sharded over a node's F ranks
COMM = Fields({"name": str, "args": Fields({"group": [int], "bytes_sent": int}, extra=True)}, extra=True)


def expected_slice(unit, grads: dict, r: int):
    """Rank r's slice of the unit's flat gradient: slice r % F, the rank's place in its node."""
    flat = FlatBuffer(unit["shapes"], F)
    flat.copy_from([grads[name] for name in unit["param_names"]])
    return flat.shard(r % F)


def _layouts(n, g):
    """(world size, F) with F dividing the world size: the edge cases (full sharding, none) and some drawn."""
    cases = [(4, 2), (4, 4), (4, 1)]
    for _ in range(3):
        f, nodes = int(torch.randint(1, 5, (), generator=g)), int(torch.randint(1, 5, (), generator=g))
        cases.append((f * nodes, f))
    return {f"hsdp_layout({world}, {f})": {"world_size": world, "F": f} for world, f in dict.fromkeys(cases)}


def what_is_wrong(world: int, f: int, shards, replicas) -> str:
    """Why (shards, replicas) is not the layout of `world` ranks in nodes of f ("" when it is), by the rules."""
    nodes = world // f
    if len(shards) != nodes or len(replicas) != f:
        swapped = len(shards) == f and len(replicas) == nodes and nodes != f
        return (
            f"{len(shards)} shard groups and {len(replicas)} replica groups; {world} ranks in nodes of {f} make "
            f"{nodes} shard groups (one per node) and {f} replica groups (one per place in a node)"
            + (": the two are swapped" if swapped else "")
        )
    for node, group in enumerate(shards):
        if group != list(range(node * f, (node + 1) * f)):
            swapped = group == list(range(node, world, nodes))
            return (
                f"shard group {node} is {group}: a shard group is one node, its {f} consecutive ranks, "
                "listed node by node"
                + (
                    ": the two are swapped. A shard group is one node, F consecutive "
                    "ranks that split the units over the fast links; a replica group is the "
                    "ranks holding the same slice, one per node"
                    if swapped
                    else ""
                )
            )
    for place, group in enumerate(replicas):
        if group != [node * f + place for node in range(nodes)]:
            return (
                f"replica group {place} is {group}: a replica group is the ranks at place {place} of every "
                "node (the ranks holding the same slice), in increasing order, listed by place"
            )
    return ""


@check(
    "hsdp_layout: shard groups are nodes of F consecutive ranks, replica groups every F-th rank",
    points=1,
    world_sizes=(4,),
    pure=True,
    cases=_layouts,
    returns={
        "layout": Items(
            List(List(int)),
            List(List(int)),
            why="hsdp_layout returns (shard groups, replica groups), each a list of lists of ranks",
        )
    },
)
def layout(ctx, given, got):
    world, f = given[0]["world_size"], given[0]["F"]
    shards, replicas = got[0]["layout"]
    why = what_is_wrong(world, f, shards, replicas)
    if why:
        ctx.fail(f"hsdp_layout({world}, {f}) returned ({shards}, {replicas}): {why}")


GROUP = {"members": [int], "sum": Tensor((1,), torch.float32)}


@check(
    "make_groups: this rank's shard group is its node, its replica group the same slot in every node",
    points=1,
    world_sizes=(4,),
    returns={"shard group": GROUP, "replica group": GROUP},
)
def groups(ctx, given, got):
    for r in range(ctx.world_size):
        node, slot = r // F, r % F
        for what, expected in (
            ("shard group", [node * F + i for i in range(F)]),
            ("replica group", list(range(slot, ctx.world_size, F))),
        ):
            members = got[r][what]["members"]
            if sorted(members) != expected:
                ctx.fail(f"rank {r}: make_groups returned a {what} of ranks {members}, expected {expected}")
            ctx.expect(
                got[r][what]["sum"],
                torch.tensor([float(sum(expected))]),
                f"an all-reduce over rank {r}'s {what}",
                rank=r,
            )


@check(
    "after one backward each rank holds its slice of the WHOLE batch's gradient: averaged inside the "
    "node, then across the nodes",
    points=2,
    world_sizes=(4,),
    inputs=training(1),
    returns={"grads": {u["name"]: Maybe(Tensor((u["shard"],), torch.float32)) for u in UNITS}},
)
def gradient_slices(ctx, given, got):
    seed, n = given[0]["seed"], ctx.world_size
    grads = {name: p.grad for name, p in local(seed, 0).named_parameters()}
    by_node = {
        node: {name: p.grad for name, p in local(seed, 0, node_batch(node, n)).named_parameters()}
        for node in range(n // F)
    }
    for r in range(n):
        for unit in UNITS:
            mine = got[r]["grads"][unit["name"]]
            if mine is None:
                ctx.fail(
                    f"rank {r}: unit {unit['name']!r} has no gradient after backward: finish_reduce must "
                    "leave the reduced slice in self.mine.grad"
                )
            expected = expected_slice(unit, grads, r)
            if not torch.allclose(mine, expected, **TOLERANCE):
                if torch.allclose(mine, expected_slice(unit, by_node[r // F], r), **TOLERANCE):
                    ctx.fail(
                        f"rank {r}: unit {unit['name']!r}'s gradient is the average over node {r // F}'s rows "
                        "only: the replicas were never averaged, so each node would train its own model. "
                        "All-reduce the slice (op='avg') over the replica group"
                    )
                ratio = (mine.double().norm() / expected.double().norm().clamp_min(1e-30)).item()
                for k, level in (
                    (F, "inside the node (reduce-scatter)"),
                    (n // F, "across the nodes (all-reduce)"),
                    (n, "at both levels"),
                ):
                    if k > 1 and abs(ratio - k) < 0.05 * k:
                        ctx.fail(
                            f"rank {r}: unit {unit['name']!r}'s gradient is {ratio:.2f}x the whole batch's: "
                            f"summed instead of averaged {level}; use op='avg'"
                        )
            ctx.expect(
                mine, expected, f"rank {r}'s gradient slice of unit {unit['name']!r}", rank=r, exact=False, **TOLERANCE
            )


@check(
    f"parity with one process: {STEPS} SGD steps give every rank the same parameters",
    points=2,
    world_sizes=(4,),
    inputs=training(STEPS),
    returns={"params": {name: like(p) for name, p in PARAMETERS.items()}},
)
def parity(ctx, given, got):
    reference = local(given[0]["seed"], STEPS)
    for r in range(ctx.world_size):
        for name, p in reference.named_parameters():
            ctx.expect(
                got[r]["params"][name],
                p.detach(),
                f"{name!r} after {STEPS} SGD steps",
                rank=r,
                exact=False,
                rtol=1e-4,
                atol=1e-5,
            )


@check(
    "bytes across nodes: only the slices' all-reduce crosses, 2(R-1)/R x Ψ/F per rank per step; inside "
    "the node 3Ψ(F-1)/F",
    points=2,
    world_sizes=(4,),
    inputs=training(1),
    returns={"comms": [COMM]},
)
def bytes_across_nodes(ctx, given, got):
    replicas = ctx.world_size // F
    for r in range(ctx.world_size):
        events = got[r]["comms"]
        across = [e for e in events if len({m // F for m in e["args"]["group"]}) > 1]
        inside = [e for e in events if len({m // F for m in e["args"]["group"]}) == 1]
        psi = sum(u["padded"] for u in UNITS)
        theory_across = sum(2 * (replicas - 1) * (u["shard"] * 4) // replicas for u in UNITS)
        theory_inside = 3 * psi * 4 * (F - 1) / F
        sent_across = sum(e["args"]["bytes_sent"] for e in across)
        sent_inside = sum(e["args"]["bytes_sent"] for e in inside)
        kinds = sorted({e["name"] for e in across})
        if not across:
            ctx.fail(
                f"rank {r}: no byte crossed from node to node in a step: the replicas were never averaged "
                "(an all-reduce of the slice over the replica group)"
            )
        if kinds != ["all_reduce"] or abs(sent_across - theory_across) > len(across):
            ctx.fail(
                f"rank {r}: {sent_across} bytes crossed nodes in a step, in {kinds}; hybrid sharding sends "
                f"across nodes only the all-reduce of each unit's slice, 2(R-1)/R x Ψ/F x 4 = {theory_across} "
                f"bytes (Ψ = {psi} padded elements, F = {F}, R = {replicas} nodes)"
            )
        if abs(sent_inside - theory_inside) > len(inside):
            ctx.fail(
                f"rank {r}: {sent_inside} bytes moved inside the node in a step; two all-gathers and one "
                f"reduce-scatter per unit within the shard group are 3Ψ(F-1)/F x 4 = {theory_inside:.0f}"
            )
