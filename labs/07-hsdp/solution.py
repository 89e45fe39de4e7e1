"""Lab 07, the reference solution: hybrid sharding's groups and its two-level gradient reduction.

Self-contained on purpose (the lab stands alone); `toolkit/parallel/fsdp_unit.py` (`sharding_groups`,
`FSDPUnit.finish_reduce`) is the same idea as the toolkit uses it.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

import toolkit
from toolkit import comm
from toolkit.parallel.fsdp_unit import FSDPUnit, Sharding


def hsdp_layout(world_size: int, F: int) -> tuple[list[list[int]], list[list[int]]]:
    shard_groups = [list(range(g * F, (g + 1) * F)) for g in range(world_size // F)]
    replica_groups = [list(range(i, world_size, F)) for i in range(F)]
    return shard_groups, replica_groups


def make_groups(F: int):
    world, rank = dist.get_world_size(), dist.get_rank()
    shard_lists, replica_lists = hsdp_layout(world, F)
    shards = [dist.new_group(ranks) for ranks in shard_lists]  # every rank creates every group, in order
    replicas = [dist.new_group(ranks) for ranks in replica_lists]
    return shards[rank // F], replicas[rank % F]


_GROUPS: dict = {}


def groups_for(F: int):
    if F not in _GROUPS:
        _GROUPS[F] = make_groups(F)
    return _GROUPS[F]


class HybridUnit(FSDPUnit):
    def __init__(self, plan, sharding, **kwargs):
        shard_group, replica_group = groups_for(sharding.size)
        super().__init__(
            plan, Sharding(shard_group, replica_group, sharding.param_dtype, sharding.reduce_dtype), **kwargs
        )

    def reduce_grad(self) -> None:
        out = torch.empty(self.grads.shard_numel, dtype=self.grads.data.dtype, device=self.master.device)
        handle = comm.reduce_scatter(out, self.grads.data, op="avg", group=self.sharding.shard_group, async_op=True)
        self.reduction, self.grads = (handle, out, self.grads), None

    def finish_reduce(self) -> None:
        handle, out, _ = self.reduction
        handle.wait()
        self.reduction = None
        comm.all_reduce(out, op="avg", group=self.sharding.replica_group)
        out = out.to(torch.float32)
        self.mine.grad = out if self.mine.grad is None else self.mine.grad.add_(out)


def wrap(
    model: torch.nn.Module, sharding_group_size: int, optimizer=functools.partial(torch.optim.SGD, lr=0.1), **options
):
    return toolkit.parallel.wrap(
        model, "fsdp", optimizer=optimizer, sharding_group_size=sharding_group_size, unit_class=HybridUnit, **options
    )
