"""Lab 08, the reference solution: where each dtype lives in FSDP's mixed precision.

Self-contained on purpose (the lab stands alone); `toolkit/parallel/fsdp_unit.py` is the same unit as
the toolkit uses it.
"""

from __future__ import annotations

import functools

import torch

import toolkit
from toolkit import comm
from toolkit.parallel.flat import FlatBuffer
from toolkit.parallel.fsdp_unit import GATHERING, SHARDED, FSDPUnit, MixedPrecision  # noqa: F401


class MixedUnit(FSDPUnit):
    def unshard(self, async_op: bool = False) -> None:
        if self.state == SHARDED:
            self.flat.allocate()
            piece = self.master.detach().to(self.sharding.param_dtype)
            handle = comm.all_gather(self.flat.data, piece, group=self.sharding.shard_group, async_op=True)
            self._gather, self.state = (handle, piece), GATHERING
        if not async_op:
            self.wait_unshard()

    def add_grad(self, p) -> bool:
        if self.grads is None:
            self.grads = FlatBuffer(
                self.flat.shapes, self.sharding.size, dtype=self.sharding.reduce_dtype, device=self.master.device
            )
        self.grads.view(self.index[p]).add_(p.grad)
        p.grad = None
        self.waiting -= 1
        return self.waiting == 0

    def reduce_grad(self) -> None:
        out = torch.empty(self.grads.shard_numel, dtype=self.grads.data.dtype, device=self.master.device)
        handle = comm.reduce_scatter(out, self.grads.data, op="avg", group=self.sharding.shard_group, async_op=True)
        self.reduction, self.grads = (handle, out, self.grads), None

    def finish_reduce(self) -> None:
        handle, out, _ = self.reduction
        handle.wait()
        self.reduction = None
        out = out.to(torch.float32)
        self.mine.grad = out if self.mine.grad is None else self.mine.grad.add_(out)


def wrap(
    model: torch.nn.Module,
    mixed_precision=MixedPrecision(torch.bfloat16),
    optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
    **options,
):
    return toolkit.parallel.wrap(
        model, "fsdp", optimizer=optimizer, mixed_precision=mixed_precision, unit_class=MixedUnit, **options
    )
