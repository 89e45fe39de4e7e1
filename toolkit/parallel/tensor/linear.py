"""Megatron's split linear layers: column-parallel, then row-parallel, one all-reduce between them.

A linear layer Y = X A (+ b) with A of shape (in, out) can be cut two ways over t ranks:

    column-parallel   A = [A_1 ... A_t] by output columns. Rank r computes Y_r = X A_r + b_r: its own
                      slice of the output features, from the whole input. No talk forward; in backward
                      each rank's dX is partial (from its columns only), so X passes through f first.
    row-parallel      A = [A_1; ...; A_t] by input rows. Rank r holds the slice X_r of the input features
                      (exactly what a column-parallel layer before it produced) and computes X_r A_r, a
                      partial sum of Y: g adds the partial sums up. The bias is added once, *after* g
                      (added before, every rank would add it and Y would hold t biases).

So an MLP, GELU(X A) B, is column-parallel A then row-parallel B: GELU acts on each hidden unit alone,
so it runs on the slices with no talk, and the block costs one all-reduce forward (g) and one backward (f).
Attention is cut the same way by heads (`attention.py`).

The layers keep the weight in the layout of the module they replace, under the same names: torch's
nn.Linear stores (out, in), Hugging Face's Conv1D (GPT-2) stores (in, out) ("transposed"), so a column
split cuts dim 0 of a Linear and dim 1 of a Conv1D. Under sequence parallelism (`sequence.py`) the
column layer all-gathers its input along the sequence instead of f, and the row layer reduce-scatters
instead of g.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .operators import TPGroup, copy_to_tp, gather_from_tp, reduce_from_tp, reduce_scatter_sequence
from .shards import COLUMNS, ROWS, Split, mark, split_of


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's Conv1D (GPT-2): a linear layer whose weight is stored (in, out)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


def split_parameter(param, split: Split | None, tp: TPGroup, done: dict, what: str):
    """This rank's piece of `param` as a new Parameter (the same one for every user of a tied weight)."""
    if param is None:
        return None
    if id(param) in done:
        new = done[id(param)]
        if split_of(new) != split:
            raise ValueError(
                f"tensor parallelism: {what} shares its weight with another layer split differently "
                f"({split_of(new)} vs {split}); give tied layers the same style (e.g. 'vocab' for an "
                f"embedding and the head that reuses it)."
            )
        return new
    if split is None:
        new = param
    else:
        split.check(param.shape[split.dim], tp.size, what)
        new = nn.Parameter(split.shard(param.detach(), tp.size, tp.rank), requires_grad=param.requires_grad)
    done[id(param)] = mark(new, split)
    return new


BACKWARD = "backward"  # tp_comm_overlap="backward": the column layers' backward collectives overlapped (overlap.py)


class ParallelLinear(nn.Module):
    """What both splits share: the weight in its original layout, and the local matmul. `comm_overlap`: True, under
    sequence parallelism, its collective runs as a ring hidden behind the GEMM, a chunk at a time; "backward", a
    column layer's backward collectives beside the GEMM that does not need them (`overlap.py`)."""

    comm_overlap: bool | str = False

    def __init__(
        self,
        module: nn.Module,
        tp: TPGroup,
        weight_split: Split,
        bias_split: Split | None,
        done: dict,
        name: str,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.transposed = is_conv1d(module)
        self.tp, self.sequence_parallel = tp, sequence_parallel
        full_in, full_out = self._in_out(module.weight)
        self.full_in_features, self.full_out_features = full_in, full_out
        self.weight = split_parameter(
            module.weight, weight_split, tp, done, f"the {self._dim_name(weight_split)} of {name!r}"
        )
        self.bias = split_parameter(module.bias, bias_split, tp, done, f"the bias of {name!r}")
        self.in_features, self.out_features = self._in_out(self.weight)
        self.name = name

    def _in_out(self, weight) -> tuple[int, int]:
        return (weight.shape[0], weight.shape[1]) if self.transposed else (weight.shape[1], weight.shape[0])

    def _dim_name(self, split: Split) -> str:
        out_dim = 1 if self.transposed else 0
        return "output features" if split.dim == out_dim else "input features"

    def matmul(self, x: torch.Tensor, bias=None) -> torch.Tensor:
        if self.transposed:
            y = x @ self.weight
            return y if bias is None else y + bias
        return F.linear(x, self.weight, bias)

    def extra_repr(self) -> str:
        overlap = {True: ", comm overlap", BACKWARD: ", backward comm overlap"}.get(self.comm_overlap, "")
        sp = (", sequence parallel" if self.sequence_parallel else "") + overlap
        return (
            f"in={self.in_features} of {self.full_in_features}, out={self.out_features} of "
            f"{self.full_out_features}, tp={self.tp.size}{sp}"
        )


class ColumnParallelLinear(ParallelLinear):
    """Y_r = f(X) A_r + b_r: this rank's output features. `gather_output` joins them (all-gather) for a
    consumer that needs every feature (a vocabulary-parallel head feeding a model's own loss). `vocab`: the
    output features are a vocabulary, padded to a multiple of t when they do not divide (`shards.py`); the
    gathered logits are cut back to the vocabulary."""

    def __init__(
        self,
        module,
        tp: TPGroup,
        done: dict,
        name: str = "",
        *,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        weight_split: Split | None = None,
        vocab: bool = False,
    ):
        out_dim = 1 if is_conv1d(module) else 0
        words = module.weight.shape[out_dim] if vocab else None
        split = weight_split or Split(out_dim, size=words)
        bias = Split(0, split.parts, size=words, sections=split.sections)
        super().__init__(module, tp, split, bias, done, name, sequence_parallel)
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel and self.comm_overlap is True:
            from .overlap import ring_gathered_linear

            y = ring_gathered_linear(x, self)
        elif self.comm_overlap == BACKWARD and self.tp.size > 1:
            from .overlap import backward_overlapped_linear

            y = backward_overlapped_linear(x, self)
        elif self.sequence_parallel:
            from .sequence import gathered_linear

            y = gathered_linear(x, self, self.tp)
        else:
            y = self.matmul(copy_to_tp(x, self.tp), self.bias)
        if not self.gather_output:
            return y
        y = gather_from_tp(y, self.tp, -1)
        return y if y.shape[-1] == self.full_out_features else y[..., : self.full_out_features]  # padding cut


class RowParallelLinear(ParallelLinear):
    """Y = g(X_r A_r) + b: partial sums added up, then the bias, once."""

    def __init__(self, module, tp: TPGroup, done: dict, name: str = "", *, sequence_parallel: bool = False):
        in_dim = 0 if is_conv1d(module) else 1
        super().__init__(module, tp, Split(in_dim), None, done, name, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            hint = (
                " It received the full width: a row-parallel layer takes the split output of a column-parallel "
                "layer before it (plan the layer before it 'colwise')."
                if x.shape[-1] == self.full_in_features
                else ""
            )
            raise ValueError(
                f"row-parallel layer {self.name!r} expects its slice of {self.in_features} input "
                f"features, got {x.shape[-1]}.{hint}"
            )
        if not self.sequence_parallel:
            y = reduce_from_tp(self.matmul(x), self.tp)  # this rank's partial sum, added up; then the bias
            return y if self.bias is None else y + self.bias
        # sequence parallel: the sum, each rank keeping its part of the sequence; the bias then acts on that
        # part only, so its gradient here is partial: f in front of it sums the ranks' parts in backward
        if self.comm_overlap is True:
            from .overlap import ring_scattered_linear

            y = ring_scattered_linear(x, self)
        else:
            y = reduce_scatter_sequence(self.matmul(x), self.tp)
        return y if self.bias is None else y + copy_to_tp(self.bias, self.tp)


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ROWS", "COLUMNS", "is_conv1d", "split_parameter"]
