"""The differentiable all-to-all of rows, the MoE layer's dispatch and combine (steps 4 and 6).

Its backward is the same all-to-all with the splits swapped: gradients return to the rank their rows came
from. Every call goes through `toolkit.comm` (or Tutel's 2DH all-to-all, `comm/hierarchical.py`), so the trace
names count exchange, dispatch and combine, forward and backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from ..comm import hierarchical
from ..trace.events import recorder


def exchange(x, out_splits, in_splits, group, label, node_size=None):
    """The door's all-to-all into a fresh tensor (Tutel's 2DH one when ``node_size`` is given,
    comm/hierarchical.py); one process alone (no process group) keeps its rows."""
    if not dist.is_initialized():
        return x.clone()
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    first = len(recorder.events)
    if node_size is None:
        comm.all_to_all(out, x.contiguous(), out_splits, in_splits, group=group)
    else:
        hierarchical.all_to_all(out, x.contiguous(), out_splits, in_splits, group=group, node_size=node_size)
    for event in recorder.events[first:] if recorder.enabled else ():  # name them on the timeline
        if event["name"] == "all_to_all":
            event["args"]["moe"] = label
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, label, node_size):
        ctx.out_splits, ctx.in_splits, ctx.group, ctx.label = out_splits, in_splits, group, label
        ctx.node_size = node_size
        return exchange(x, out_splits, in_splits, group, label, node_size)

    @staticmethod
    def backward(ctx, grad):
        # Rows came from rank j (out_splits[j] of them): their gradients go back to rank j.
        back = exchange(grad, ctx.in_splits, ctx.out_splits, ctx.group, ctx.label + " backward", ctx.node_size)
        return back, None, None, None, None, None


def all_to_all(x: torch.Tensor, out_splits, in_splits, group=None, label="all_to_all", node_size=None) -> torch.Tensor:
    """Differentiable all-to-all of rows: send ``in_splits[j]`` rows to rank j, get ``out_splits[j]``
    (``node_size``: Tutel's 2DH all-to-all over nodes of that many ranks, the same result)."""
    return _AllToAll.apply(x, [int(s) for s in out_splits], [int(s) for s in in_splits], group, label, node_size)
