"""Lab 06, the reference solution: ZeRO stage 2's gradient reduce-scatter and the partitioned optimizer step.

Self-contained on purpose (the lab stands alone); `toolkit/parallel/zero.py` is the same idea with
buckets that reduce during backward, mixed precision and gradient accumulation.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from toolkit import comm
from toolkit.parallel.flat import FlatBuffer


def shard_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int, int]:
    padded = numel + (-numel) % world_size
    size = padded // world_size
    return rank * size, (rank + 1) * size, padded


class Zero2:
    """The model's parameters laid out in one flat fp32 buffer; rank r owns, steps and keeps the gradient
    of slice r only."""

    def __init__(self, model: nn.Module, optimizer=torch.optim.AdamW, group=None):
        self.group = group
        ranks = comm.group_ranks(group)
        self.world = len(ranks)
        self.rank = ranks.index(torch.distributed.get_rank())
        self.params = list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))
        self.flat = FlatBuffer.of(self.params, self.world, dtype=torch.float32)
        with torch.no_grad():
            for p, view in zip(self.params, self.flat.views()):
                p.data = view  # the model computes with views of the flat buffer
        start, end, padded = shard_bounds(self.flat.numel, self.world, self.rank)
        assert padded == self.flat.padded_numel, "shard_bounds disagrees with the flat buffer's padding"
        self.master = nn.Parameter(self.flat.data[start:end])  # a view: stepping it updates the model's slice
        self.optimizer = optimizer([self.master])
        self._queued = False
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._gradient_arrived)

    def _gradient_arrived(self, p) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._queued = False
        self.reduce_gradients()

    def reduce_gradients(self) -> None:
        grads = FlatBuffer(self.flat.shapes, self.world, dtype=torch.float32)
        for p, view in zip(self.params, grads.views()):
            if p.grad is not None:
                view.copy_(p.grad)
        out = torch.empty(grads.shard_numel, dtype=torch.float32)
        comm.reduce_scatter(out, grads.data, op="avg", group=self.group)
        self.master.grad = out
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.optimizer.step()
        comm.all_gather(self.flat.data, self.master.detach().clone(), group=self.group)
        self.master.grad = None

    def zero_grad(self) -> None:
        self.master.grad = None
        for p in self.params:
            p.grad = None
