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

    Ranks are numbered node by node, F per node. A *shard group* is one node: F consecutive ranks that split every
    unit F ways and talk over the fast links inside the node. A *replica group* is the ranks that hold the same
    slice, one per node. Example: hsdp_layout(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]]).
    """
    raise NotImplementedError("hsdp_layout: not written yet")


def make_groups(F: int):
    """(this rank's shard group, this rank's replica group), as process groups (your `hsdp_layout`), for the
    world of all ranks; `dist.new_group`'s rule is in README.md.
    """
    raise NotImplementedError("make_groups: not written yet")


_GROUPS: dict = {}


def groups_for(F: int):
    """Given: the groups are made once per job (all ranks build their units in the same order)."""
    if F not in _GROUPS:
        _GROUPS[F] = make_groups(F)
    return _GROUPS[F]


class HybridUnit(FSDPUnit):
    """One FSDP unit that shards over your shard group and averages over your replica group.

    Given: `__init__` builds the unit (flat parameter, this rank's fp32 master slice) over your groups:
    self.sharding.shard_group, .replica_group, .size (F), .rank (the slice this rank owns), .reduce_dtype.
    During backward FSDP fills `self.grads` (a FlatBuffer: `self.grads.data` is the unit's full flat
    gradient of this rank's rows, padded to a multiple of F, in `self.sharding.reduce_dtype`: fp32 in this lab;
    `self.grads.shard_numel` is one slice's size), then calls `reduce_grad()`, and at the end of backward
    `finish_reduce()`.
    self.reduction what your `reduce_grad` leaves for your `finish_reduce`: (handle, output, input) while a
                   reduce-scatter is in flight (FSDP looks at it: not None means "still to finish"), else None.
    self.mine      the `Shard` the optimizer reads: `self.mine.grad` is this rank's fp32 gradient slice
                   (`shard_numel` elements), None after `zero_grad`.
    self.master    this rank's fp32 slice of the parameters (`self.master.device`: where tensors live).
    """

    def __init__(self, plan, sharding, **kwargs):
        shard_group, replica_group = groups_for(sharding.size)
        super().__init__(
            plan, Sharding(shard_group, replica_group, sharding.param_dtype, sharding.reduce_dtype), **kwargs
        )

    # --- yours: 2. level one, inside the node ---------------------------------------------------------------
    def reduce_grad(self) -> None:
        """Level one, inside the node: start averaging the unit's flat gradient (`self.grads.data`, this rank's rows)
        over the shard group, asynchronously, this rank receiving its slice only. Leave (handle, output, input) in
        `self.reduction` for `finish_reduce` (the input must live until the bytes have travelled), and let the next
        backward start without `self.grads`.
        """
        raise NotImplementedError("reduce_grad: not written yet")

    # --- yours: 3. level two, across the nodes ----------------------------------------------------------
    def finish_reduce(self) -> None:
        """Level two, across the nodes, then keep the result. After level one this rank's slice is the average over
        *its node's* rows only; every node holds a different part of the batch, so the slice must then be averaged
        over the ranks holding the same slice in every node (the replica group). Only these bytes cross from node to
        node: Ψ/F per rank, not Ψ (the grader counts them). Afterwards `self.mine.grad` holds the slice in fp32,
        accumulated over the backwards since the last zero_grad, and `self.reduction` is empty.
        """
        raise NotImplementedError("finish_reduce: not written yet")


# --- given: FSDP with your unit -------------------------------------------------------------------------
def wrap(
    model: torch.nn.Module, sharding_group_size: int, optimizer=functools.partial(torch.optim.SGD, lr=0.1), **options
):
    """`toolkit.parallel.wrap(model, "fsdp", sharding_group_size=F, unit_class=HybridUnit)`: (model, optimizer)."""
    return toolkit.parallel.wrap(
        model, "fsdp", optimizer=optimizer, sharding_group_size=sharding_group_size, unit_class=HybridUnit, **options
    )
