"""Lab 07: hybrid sharding (HSDP), written by you: the shard and replicate groups, and the two-level
gradient reduction.

Four pieces are yours (marked "yours" below): `hsdp_layout`, `make_groups`, and two methods of
`HybridUnit`, `reduce_grad` and `finish_reduce`. Everything else is the toolkit's FSDP, which calls your
unit's methods once the given `wrap` plugs it in. Read README.md first, then grade your work with

    python -m toolkit grade labs/07-hsdp                     # grades this file
    python -m toolkit grade labs/07-hsdp --solution my.py    # or a copy of it

Rule of the game: every collective goes through `toolkit.comm` (`comm.reduce_scatter`, `comm.all_reduce`),
so the trace records it and the grader can count the bytes that crossed from node to node.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist  # noqa: F401 - you will need it

import toolkit
from toolkit import comm  # noqa: F401 - you will need it
from toolkit.parallel.fsdp_unit import FSDPUnit, Sharding


# --- yours: 1. who shards with whom, who replicates with whom --------------------------------------------
def hsdp_layout(world_size: int, F: int) -> tuple[list[list[int]], list[list[int]]]:
    """(shard groups, replica groups) for `world_size` ranks sharded F ways, as lists of global ranks.

    Ranks are numbered node by node, F per node: a *shard group* is one node, F consecutive ranks
    (they split every unit F ways and talk over the fast links inside the node). A *replica group* is
    the ranks holding the same slice in every node: the i-th rank of each node.
    hsdp_layout(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]]).
    """
    raise NotImplementedError("hsdp_layout: consecutive blocks of F ranks, and every F-th rank from i")


def make_groups(F: int):
    """(this rank's shard group, this rank's replica group), as process groups made with `dist.new_group`.

    `dist.new_group(ranks)` must be called by *every* rank of the job, for *every* group, in the same
    order, even for groups the rank is not in (the ranks agree on each group by counting calls). Make
    all the shard groups, then all the replica groups (from your `hsdp_layout`), and return the two that
    contain this rank (`dist.get_rank()`).
    """
    raise NotImplementedError("make_groups: dist.new_group for every group on every rank, return mine")


_GROUPS: dict = {}


def groups_for(F: int):
    """Given: the groups are made once per job (all ranks build their units in the same order)."""
    if F not in _GROUPS:
        _GROUPS[F] = make_groups(F)
    return _GROUPS[F]


class HybridUnit(FSDPUnit):
    """One FSDP unit that shards over your shard group and averages over your replica group.

    Given: `__init__` builds the unit (flat parameter, this rank's fp32 master slice) over your groups:
    self.sharding.shard_group, .replica_group, .size (F), .rank (the slice this rank owns).
    During backward FSDP fills `self.grads` (a FlatBuffer: `self.grads.data` is the unit's full flat
    gradient of this rank's rows), then calls `reduce_grad()`, and at the end of backward `finish_reduce()`.
    """

    def __init__(self, plan, sharding, **kwargs):
        shard_group, replica_group = groups_for(sharding.size)
        super().__init__(plan, Sharding(shard_group, replica_group, sharding.param_dtype, sharding.reduce_dtype),
                         **kwargs)

    # --- yours: 2. level one, inside the node ---------------------------------------------------------------
    def reduce_grad(self) -> None:
        """Start the reduce-scatter inside the node: average the flat gradient over the shard group, this
        rank receiving its slice only.

        1. `out = torch.empty(self.grads.shard_numel, dtype=self.grads.data.dtype, device=self.master.device)`
        2. `handle = comm.reduce_scatter(out, self.grads.data, op="avg", group=self.sharding.shard_group,
           async_op=True)`
        3. `self.reduction = (handle, out, self.grads)` (keeps the input alive while it travels), then
           `self.grads = None`.
        """
        raise NotImplementedError("reduce_grad: reduce-scatter (op='avg') over the shard group, asynchronously")

    # --- yours: 3. level two, across the nodes ----------------------------------------------------------
    def finish_reduce(self) -> None:
        """Finish what `reduce_grad` started, then average the slice across the nodes, and keep it.

        1. `handle, out, _ = self.reduction`; `handle.wait()`; `self.reduction = None`. Now `out` is the
           average of this slice over *this node's* rows of the batch.
        2. Every node holds a different part of the batch: all-reduce `out` with op="avg" over
           `self.sharding.replica_group` (one rank per node, all holding this same slice). Only these
           bytes cross from node to node: Ψ/F per rank, not Ψ.
        3. Add it, as fp32, into the slice's gradient: `self.mine.grad` (None after zero_grad: then it
           becomes `out`; otherwise add into it, so micro-batches accumulate).
        """
        raise NotImplementedError("finish_reduce: wait, all-reduce (op='avg') over the replica group, keep the slice")


# --- given: FSDP with your unit -------------------------------------------------------------------------
def wrap(model: torch.nn.Module, sharding_group_size: int, optimizer=functools.partial(torch.optim.SGD, lr=0.1),
         **options):
    """`toolkit.parallel.wrap(model, "fsdp", sharding_group_size=F, unit_class=HybridUnit)`: (model, optimizer)."""
    return toolkit.parallel.wrap(model, "fsdp", optimizer=optimizer, sharding_group_size=sharding_group_size,
                                 unit_class=HybridUnit, **options)
