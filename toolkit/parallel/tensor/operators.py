"""Megatron's conjugate operators: the only places where tensor-parallel ranks talk.

Inside a tensor-parallel group every rank holds the same activations X, but only its slice of some
weights. Two operators (Shoeybi et al. 2019, section 3) make the split layers exact:

    f  (`copy_to_tp`)      forward: identity         backward: all-reduce the gradient
    g  (`reduce_from_tp`)  forward: all-reduce       backward: identity

f sits before a column-parallel layer: every rank uses the same X, so X's gradient is the *sum* of
what each rank's slice contributes. g sits after a row-parallel layer: each rank computed a partial sum
of the output, so the forward adds them up; the output's gradient is already the same everywhere.
They are conjugate: f's backward is g's forward and the other way round, so a block written as
f -> column -> row -> g talks exactly twice per pass, once forward and once backward.

Sequence parallelism (Korthikanti et al. 2022) cuts the all-reduce in two, a reduce-scatter and an
all-gather, and keeps the activations between a g and the next f split along the sequence:

    `gather_from_sequence`     forward: all-gather (sequence)   backward: reduce-scatter (sequence)
    `reduce_scatter_sequence`  forward: reduce-scatter          backward: all-gather

Two more move a tensor between "the same on every rank" and "split" without any arithmetic
(Megatron's scatter/gather "to/from the model-parallel region"):

    `scatter_to_tp(x, dim)`    forward: keep my chunk (no talk)  backward: all-gather the chunks
    `gather_from_tp(x, dim)`   forward: all-gather the chunks    backward: keep my chunk

Every collective goes through `toolkit.comm` with the tensor-parallel group, so the trace records it
with its group, and its span says which operator issued it (`args["tp"]`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ... import comm


@dataclass(frozen=True)
class TPGroup:
    """This rank's tensor-parallel group: the process group, its size t and this rank's index in it."""

    group: object
    size: int
    rank: int

    @classmethod
    def of(cls, group) -> TPGroup:
        ranks = comm.group_ranks(group)
        return cls(group, len(ranks), ranks.index(dist.get_rank()))


def labelled(call, label: str):
    """Run `call()`, one collective through the door, and name the operator that issued it on its span
    (`args["tp"]`); returns what the call returns (a handle where it was asynchronous)."""
    issued = []
    with comm.listening(lambda kind, event, tensor: issued.append(event) if kind == "issue" else None):
        result = call()
    for event in issued:
        event["args"]["tp"] = label
    return result


class InFlight:
    """An asynchronous collective of this file: `wait()` returns its result (`tp_comm_overlap` starts one beside a
    GEMM that does not need it, `overlap.py`)."""

    def __init__(self, handle, result):
        self.handle, self.result = handle, result

    def wait(self) -> torch.Tensor:
        if self.handle is not None:
            self.handle.wait()
        return self.result()


def all_reduce(x: torch.Tensor, tp: TPGroup, label: str, async_op: bool = False):
    """The sum of every rank's `x` (async_op: an `InFlight` that gives it)."""
    out = x.contiguous().clone()
    handle = labelled(lambda: comm.all_reduce(out, group=tp.group, async_op=async_op), label)
    started = InFlight(handle, lambda: out)
    return started if async_op else started.wait()


def all_gather(x: torch.Tensor, tp: TPGroup, dim: int, label: str, async_op: bool = False):
    """Every rank's `x` side by side along `dim`, in rank order (async_op: an `InFlight` that gives it). Synchronous
    by default: the next operation needs its result, so nothing could hide it."""
    out = x.new_empty((tp.size,) + tuple(x.shape))
    handle = labelled(lambda: comm.all_gather(out, x.contiguous(), group=tp.group, async_op=async_op), label)
    started = InFlight(handle, lambda: torch.cat(out.unbind(0), dim=dim))
    return started if async_op else started.wait()


def reduce_scatter(x: torch.Tensor, tp: TPGroup, dim: int, label: str, async_op: bool = False):
    """Chunk `rank` (along `dim`) of the sum of every rank's `x` (async_op: an `InFlight` that gives it)."""
    chunks = torch.stack(split(x, tp, dim)).contiguous()
    out = x.new_empty(chunks.shape[1:])
    handle = labelled(lambda: comm.reduce_scatter(out, chunks, group=tp.group, async_op=async_op), label)
    started = InFlight(handle, lambda: out)
    return started if async_op else started.wait()


def split(x: torch.Tensor, tp: TPGroup, dim: int) -> tuple:
    """`x` cut into the t ranks' chunks along `dim` (the sequence, under sequence parallelism)."""
    if x.shape[dim] % tp.size:
        raise ValueError(
            f"tensor parallelism: dimension {dim} of size {x.shape[dim]} does not split over "
            f"tp={tp.size} ranks; with sequence_parallel the sequence length must be a multiple of tp."
        )
    return x.chunk(tp.size, dim=dim)


def my_chunk(x: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    if x.shape[dim] % tp.size:
        raise ValueError(
            f"tensor parallelism: dimension {dim} of size {x.shape[dim]} does not split over "
            f"tp={tp.size} ranks; use a sequence length (or batch) that is a multiple of tp."
        )
    return x.chunk(tp.size, dim=dim)[tp.rank].contiguous()


# --- the conjugate pair ---------------------------------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.tp, "f backward"), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, tp):
        return all_reduce(x, tp, "g forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Megatron's f. Also put in front of a *replicated parameter* that computes on split data (a layer
    norm under sequence parallelism): each rank's gradient of it is partial, and f's backward sums them."""
    return x if tp.size == 1 else _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Megatron's g."""
    return x if tp.size == 1 else _ReduceFromTP.apply(x, tp)


# --- sequence parallelism: each all-reduce as a reduce-scatter and an all-gather -------------------------
class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, dim):
        ctx.tp, ctx.dim = tp, dim
        return all_gather(x, tp, dim, "sequence all-gather")

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.tp, ctx.dim, "sequence all-gather backward"), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, dim):
        ctx.tp, ctx.dim = tp, dim
        return reduce_scatter(x, tp, dim, "sequence reduce-scatter")

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.tp, ctx.dim, "sequence reduce-scatter backward"), None, None


def gather_from_sequence(x: torch.Tensor, tp: TPGroup, dim: int = 1) -> torch.Tensor:
    """Sequence parallelism's f: the whole sequence from every rank's part (all-gather)."""
    return x if tp.size == 1 else _GatherFromSequence.apply(x, tp, dim)


def reduce_scatter_sequence(x: torch.Tensor, tp: TPGroup, dim: int = 1) -> torch.Tensor:
    """Sequence parallelism's g: partial sums added up, each rank keeping its part of the sequence."""
    return x if tp.size == 1 else _ReduceScatterSequence.apply(x, tp, dim)


# --- between "the same everywhere" and "split", no arithmetic --------------------------------------------
class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, dim):
        ctx.tp, ctx.dim = tp, dim
        return my_chunk(x, tp, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.tp, ctx.dim, "scatter backward"), None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, dim):
        ctx.tp, ctx.dim = tp, dim
        return all_gather(x, tp, dim, "gather")

    @staticmethod
    def backward(ctx, grad):
        return my_chunk(grad, ctx.tp, ctx.dim), None, None


def scatter_to_tp(x: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    """Keep this rank's chunk of a tensor every rank holds alike; backward gathers the gradient back."""
    return x if tp.size == 1 else _ScatterToTP.apply(x, tp, dim)


def gather_from_tp(x: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    """Every rank's chunk joined along `dim`; backward keeps this rank's chunk of the gradient."""
    return x if tp.size == 1 else _GatherFromTP.apply(x, tp, dim)
