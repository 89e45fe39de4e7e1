"""Lab 11: tensor parallelism, written by you: Megatron's f and g, and a column-then-row-parallel MLP.

Four pieces are yours (marked "yours" below): the operators f (`CopyToTP`) and g (`ReduceFromTP`), and the
forwards of `ColumnParallelLinear` and `RowParallelLinear`. Given: each layer's `__init__`, which keeps this
rank's piece of a whole nn.Linear, and `ParallelMLP`, which chains them. Read README.md first, then grade
your work with

    python -m toolkit grade labs/11-tensor-parallel                     # grades this file
    python -m toolkit grade labs/11-tensor-parallel --solution my.py    # or a copy of it

Rule of the game: every collective goes through `toolkit.comm` (`comm.all_reduce(tensor, group=...)`), so
the trace records it and the grader can count what travelled.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from toolkit import comm


def _rank_and_size(group) -> tuple[int, int]:
    ranks = comm.group_ranks(group)
    return ranks.index(torch.distributed.get_rank()), len(ranks)


# --- yours: 1. the conjugate operators --------------------------------------------------------------------
class CopyToTP(torch.autograd.Function):
    """f, entering the tensor-parallel region: every rank goes on with the whole X, and X's gradient is the whole
    MLP's on every rank."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("CopyToTP.forward: not written yet")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("CopyToTP.backward: not written yet")


class ReduceFromTP(torch.autograd.Function):
    """g, leaving the tensor-parallel region: every rank goes on with the whole Y (the sum of the ranks' partial
    results), and each rank's partial result gets its right gradient."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("ReduceFromTP.forward: not written yet")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("ReduceFromTP.backward: not written yet")


# --- the layers: __init__ given, forward yours --------------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """Y_r = f(X) A_r^T + b_r: this rank's slice of the output features, from the whole input.

    Given: `self.weight` (out/t, in) holds rows r·out/t .. (r+1)·out/t - 1 of the whole layer's weight (its
    output features), `self.bias` the same slice of the bias; `self.group` the tensor-parallel group."""

    def __init__(self, whole: nn.Linear, group=None):
        super().__init__()
        self.group = group
        rank, size = _rank_and_size(group)
        self.weight = nn.Parameter(whole.weight.detach().chunk(size, dim=0)[rank].clone())
        self.bias = nn.Parameter(whole.bias.detach().chunk(size, dim=0)[rank].clone())

    # --- yours: 2 ------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("ColumnParallelLinear.forward: not written yet")


class RowParallelLinear(nn.Module):
    """Y = sum over ranks r of X_r A_r^T, plus b: the whole output, from this rank's slice X_r of the input features.

    Given: `self.weight` (out, in/t) holds columns r·in/t .. (r+1)·in/t - 1 of the whole weight (its input
    features), `self.bias` the whole bias (every rank holds it); `self.group` the tensor-parallel group."""

    def __init__(self, whole: nn.Linear, group=None):
        super().__init__()
        self.group = group
        rank, size = _rank_and_size(group)
        self.weight = nn.Parameter(whole.weight.detach().chunk(size, dim=1)[rank].clone())
        self.bias = nn.Parameter(whole.bias.detach().clone())

    # --- yours: 3 ------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("RowParallelLinear.forward: not written yet")


class ParallelMLP(nn.Module):
    """Given: an MLP d -> 4d -> GELU -> d (the toolkit GPT's `MLP`: `fc`, then `proj`), split over the group."""

    def __init__(self, whole_mlp: nn.Module, group=None):
        super().__init__()
        self.fc = ColumnParallelLinear(whole_mlp.fc, group)
        self.proj = RowParallelLinear(whole_mlp.proj, group)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))
