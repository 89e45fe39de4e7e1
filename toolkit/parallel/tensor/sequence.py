"""Sequence parallelism (Korthikanti et al. 2022): the parts of a block that tensor parallelism left
whole on every rank (layer norms, dropout, the residual adds) split along the sequence instead.

Under plain tensor parallelism every rank of the group holds the whole (b, s, h) activation between the
split layers, and computes the layer norms on it, the same work t times, the same bytes t times. Those
regions are elementwise along the sequence, so each rank can do its s/t positions only:

    [LN, dropout, residual on s/t] -all-gather-> [column | attention or GELU | row] -reduce-scatter-> [s/t ...]

The all-gather replaces f, the reduce-scatter replaces g: a ring all-reduce *is* a reduce-scatter and an
all-gather, so the bytes stay the same while the activations between the split layers shrink t-fold.

One more saving makes the per-layer activations exactly s·b·h·34/t (Korthikanti's formula): the column
layer does not keep the all-gathered input for its weight gradient; it keeps its own s/t part and
all-gathers it *again* in backward (`gathered_linear`, Megatron's LinearWithGradAccumulation...). That
costs one extra all-gather per column layer in backward, on the critical path unless overlapped.

A replicated parameter that computes on s/t of the positions (a layer norm's weight and bias, the bias
of a row-parallel layer) gets only this rank's share of its gradient; the full gradient is the sum over
the group (Megatron all-reduces these "sequence-parallel" gradients after backward). Here f in front
of the parameter sums them inside backward (`sum_gradients_over_tp`), because a data-parallel strategy
reads every gradient the moment it is final.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from .operators import TPGroup, all_gather, copy_to_tp, reduce_scatter

SEQUENCE_DIM = 1  # activations are (batch, sequence, hidden)


class _GatheredLinear(torch.autograd.Function):
    """Y = all_gather(X_r) A_r^T + b_r, keeping X_r (not the gathered X) for backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        ctx.layer, ctx.has_bias = layer, bias is not None
        ctx.save_for_backward(x, weight)
        total = all_gather(x, layer.tp, SEQUENCE_DIM, "sequence all-gather")
        return layer.matmul(total, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        layer = ctx.layer
        total = all_gather(x, layer.tp, SEQUENCE_DIM, "sequence all-gather again")  # not stored: gathered again
        grad_total = grad @ (weight.t() if layer.transposed else weight)
        grad_x = reduce_scatter(grad_total, layer.tp, SEQUENCE_DIM, "sequence all-gather backward")
        g, t = grad.reshape(-1, grad.shape[-1]), total.reshape(-1, total.shape[-1])
        grad_weight = t.t() @ g if layer.transposed else g.t() @ t
        grad_bias = g.sum(0) if ctx.has_bias else None
        return grad_x, grad_weight, grad_bias, None


def gathered_linear(x: torch.Tensor, layer, tp: TPGroup) -> torch.Tensor:
    """A column-parallel layer's forward under sequence parallelism."""
    if tp.size == 1:
        return layer.matmul(x, layer.bias)
    return _GatheredLinear.apply(x, layer.weight, layer.bias, layer)


class SequenceParallelLayerNorm(nn.LayerNorm):
    """A LayerNorm on this rank's s/t positions; its weight and bias gradients summed over the group."""

    tp: TPGroup

    def forward(self, x):
        return F.layer_norm(
            x, self.normalized_shape, copy_to_tp(self.weight, self.tp), copy_to_tp(self.bias, self.tp), self.eps
        )


@contextlib.contextmanager
def summed_gradients(module: nn.Module, tp: TPGroup):
    """Inside, `module`'s own parameters are seen through f: code that reads `module.weight` directly (an
    MoE gate's F.linear on its router's weight) gets f(weight), so the weight's gradient is summed over the
    group. The Parameters stay the leaves that gradients accumulate into (functional_call does the same)."""
    saved = dict(module._parameters)
    try:
        for name, p in saved.items():
            if p is not None:
                module._parameters[name] = copy_to_tp(p, tp)
        yield module
    finally:
        module._parameters.update(saved)


def sum_gradients_over_tp(module: nn.LayerNorm, tp: TPGroup) -> nn.Module:
    """Make a replicated LayerNorm sum its weight's and bias's gradients over the tensor-parallel group (in
    place: the class changes, the parameters and their names stay, as FSDP2's fully_shard does)."""
    if type(module) is nn.LayerNorm:
        module.__class__ = SequenceParallelLayerNorm
    elif not isinstance(module, SequenceParallelLayerNorm):
        raise TypeError(f"sum_gradients_over_tp takes an nn.LayerNorm, got {type(module).__name__}.")
    module.tp = tp
    return module
