"""Tensor-parallel communication hidden behind the GEMMs (`tp_comm_overlap=True`; Megatron-Core's
`--tp-comm-overlap`, TransformerEngine's ring exchange; torchtitan's async tensor parallelism).

Under sequence parallelism (`sequence.py`) a column-parallel layer all-gathers its input along the sequence and
then multiplies; a row-parallel layer multiplies and then reduce-scatters. Each waits for its whole collective, and
nothing else runs meanwhile: the GEMM needs all of it. Cut the sequence into the t ranks' chunks and each
collective becomes a ring whose every pass hides behind one chunk's GEMM:

    all-gather, then GEMM      t steps: multiply the chunk in hand while the next one arrives from the previous
                               rank (after t - 1 passes every chunk has visited every rank)
    GEMM, then reduce-scatter  t steps: multiply this rank's part of one chunk's sum while the running sum of the
                               chunk before travels on; each rank adds its part and passes it along, and after
                               t - 1 passes each rank holds the whole sum of its own chunk

The bytes are the collective's, (t - 1)/t of the message a rank, but sent to one neighbour a pass
(`toolkit.comm.isend`/`irecv`, labelled `args["tp"]` on the trace), and the arithmetic is the same GEMM cut in t
pieces: the same sums, added in another order (equal to the blocking layers to rounding). Backward, as
TransformerEngine does it: the row layer gathers its output's gradient around a ring, the input's gradient a chunk at
a time, then the weight's in one GEMM; the column layer starts each of its two collectives beside the GEMM that does
not need it (the input gathered again while the input's gradient is multiplied out, that gradient reduce-scattered
while the weight's is), whole GEMMs, not chunks (a weight's gradient summed chunk by chunk would read and write the
whole of it t times).

What it hides depends on a chunk's GEMM taking longer than its pass: on a GPU the links are hardware of their own;
on a CPU gloo's threads copy on the cores the ranks compute on, so the overlap is partial (the simulator prices
both: `toolkit.sim.timeline`).

`tp_comm_overlap="backward"` is Megatron-LM's own overlap, before TransformerEngine (its default since 3f65246,
2021-09, which `--no-async-tensor-model-parallel-allreduce` turns off; under sequence parallelism since cfd2e21,
2022-04, `LinearWithGradAccumulationAndAsyncCommunication`; Korthikanti et al. 2022 timed their runs with it): the
forward's collectives block, and only the column layer's backward hides its collectives behind the GEMM that does
not need them, as above; without sequence parallelism that is f's all-reduce of the input's gradient beside the
weight's gradient. The same collectives and arithmetic as blocking.
"""

from __future__ import annotations

import torch

from ..context.ring import Ring
from .operators import all_gather, all_reduce, reduce_scatter, split
from .sequence import SEQUENCE_DIM, _GatheredLinear


def ring_of(layer) -> Ring:
    """The layer's tensor-parallel group as a ring whose passes are labelled `args["tp"]`."""
    return Ring(layer.tp.group, key="tp")


def ring_gather(block: torch.Tensor, ring: Ring, visit, label: str) -> None:
    """`visit(chunk, owner)` on this rank's `block`, then on every other rank's as it arrives (`owner`: its ring
    index); the next chunk is in flight while `visit` computes on this one."""
    for step in range(ring.size):
        passing = ring.pass_on(block, label) if step < ring.size - 1 else None
        visit(block, ring.source(step))
        if passing is not None:
            block = passing.wait()


def ring_reduce_scatter(part, ring: Ring, label: str) -> torch.Tensor:
    """The sum over the ring of `part(c)` for c = this rank's index. The running sum of chunk c starts at rank c + 1
    and travels c + 1 -> c + 2 -> ... -> c; at step k this rank computes its part of chunk (rank - 1 - k) mod t while
    the running sum of the chunk before is on its way to it."""
    t, me = ring.size, ring.rank
    total = part((me - 1) % t)
    for step in range(1, t):
        passing = ring.pass_on(total, label)
        mine = part((me - 1 - step) % t)
        total = passing.wait() + mine
    return total


def _input_grad(grad: torch.Tensor, weight: torch.Tensor, layer) -> torch.Tensor:
    return grad @ (weight.t() if layer.transposed else weight)


def _weight_grad(x: torch.Tensor, grad: torch.Tensor, layer) -> torch.Tensor:
    g, a = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    return a.t() @ g if layer.transposed else g.t() @ a


def overlapped_backward(ctx, grad):
    """A column layer's backward under sequence parallelism, its two collectives each beside the GEMM that does not
    need it (TransformerEngine's bulk overlap, Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication): the
    input gathered again while the input's gradient is multiplied out, that gradient reduce-scattered while the
    weight's is."""
    x, weight = ctx.saved_tensors
    layer = ctx.layer
    gathering = all_gather(x, layer.tp, SEQUENCE_DIM, "column backward all-gather (input again)", async_op=True)
    grad_total = _input_grad(grad, weight, layer)
    total = gathering.wait()
    scattering = reduce_scatter(grad_total, layer.tp, SEQUENCE_DIM, "column backward reduce-scatter", async_op=True)
    grad_weight = _weight_grad(total, grad, layer)
    grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
    return scattering.wait(), grad_weight, grad_bias, None


class _RingGatheredLinear(torch.autograd.Function):
    """Column-parallel under sequence parallelism: Y = [X_0; ...; X_t-1] A_r + b_r, a chunk of X at a time."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        ctx.layer, ctx.has_bias = layer, bias is not None
        ctx.save_for_backward(x, weight)
        ring, pieces = ring_of(layer), [None] * layer.tp.size
        ring_gather(x, ring, lambda chunk, owner: pieces.__setitem__(owner, layer.matmul(chunk, bias)), "column ring")
        return torch.cat(pieces, dim=SEQUENCE_DIM)

    backward = staticmethod(overlapped_backward)


class _GatheredLinearOverlappedBackward(_GatheredLinear):
    """Column-parallel under sequence parallelism as Megatron-LM ran it before TransformerEngine: the input
    all-gathered, then multiplied (blocking, `sequence._GatheredLinear`); backward overlapped."""

    backward = staticmethod(overlapped_backward)


class _ReducedInBackwardLinear(torch.autograd.Function):
    """Column-parallel without sequence parallelism, f fused in (Megatron-LM's `--async-tensor-model-parallel-
    allreduce`): forward X A_r + b_r; backward starts the all-reduce of the input's partial gradient, computes the
    weight's gradient meanwhile, then waits."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        ctx.layer, ctx.has_bias = layer, bias is not None
        ctx.save_for_backward(x, weight)
        return layer.matmul(x, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        layer = ctx.layer
        reducing = all_reduce(_input_grad(grad, weight, layer), layer.tp, "column backward all-reduce", async_op=True)
        grad_weight = _weight_grad(x, grad, layer)
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        return reducing.wait(), grad_weight, grad_bias, None


class _RingScatteredLinear(torch.autograd.Function):
    """Row-parallel under sequence parallelism: this rank's chunk of sum_r X_r B_r, one chunk's GEMM at a time."""

    @staticmethod
    def forward(ctx, x, weight, layer):
        ctx.layer = layer
        ctx.save_for_backward(x, weight)
        chunks = split(x, layer.tp, SEQUENCE_DIM)
        return ring_reduce_scatter(lambda c: layer.matmul(chunks[c]), ring_of(layer), "row ring")

    @staticmethod
    def backward(ctx, grad):
        """The output's gradient gathered around the ring, the input's gradient multiplied out a chunk at a time as
        they arrive; then the weight's gradient, one GEMM on the whole sequence."""
        x, weight = ctx.saved_tensors
        layer, ring = ctx.layer, ring_of(ctx.layer)
        arrived, pieces = [None] * ring.size, [None] * ring.size

        def input_grad(chunk, owner):
            arrived[owner], pieces[owner] = chunk, _input_grad(chunk, weight, layer)

        ring_gather(grad, ring, input_grad, "row ring backward")
        grad_weight = _weight_grad(x, torch.cat(arrived, dim=SEQUENCE_DIM), layer)
        return torch.cat(pieces, dim=SEQUENCE_DIM), grad_weight, None


def ring_gathered_linear(x: torch.Tensor, layer) -> torch.Tensor:
    """A column-parallel layer's forward under sequence parallelism, its all-gather hidden chunk by chunk."""
    return _RingGatheredLinear.apply(x, layer.weight, layer.bias, layer)


def ring_scattered_linear(x: torch.Tensor, layer) -> torch.Tensor:
    """A row-parallel layer's partial sums reduce-scattered along the sequence, hidden chunk by chunk (no bias)."""
    return _RingScatteredLinear.apply(x, layer.weight, layer)


def backward_overlapped_linear(x: torch.Tensor, layer) -> torch.Tensor:
    """A column-parallel layer's forward with its backward's collectives overlapped (`tp_comm_overlap="backward"`),
    under sequence parallelism or not."""
    if layer.sequence_parallel:
        return _GatheredLinearOverlappedBackward.apply(x, layer.weight, layer.bias, layer)
    return _ReducedInBackwardLinear.apply(x, layer.weight, layer.bias, layer)
