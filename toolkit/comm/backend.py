"""The backend's own collectives (NCCL or gloo), behind the signatures every implementation shares.

A hand-written implementation (ring, pairwise exchange, a student's lab) provides functions with
these same signatures; `toolkit.comm.use` swaps them in. `async_op=True` returns torch's Work.
"""

from __future__ import annotations

import torch.distributed as dist

# torch 2.13 renamed the tensor-in, tensor-out forms; older releases only have the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_reduce(tensor, op, group, async_op):
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce_scatter(output, input, op, group, async_op):
    return _reduce_scatter(output.view(-1), input.reshape(-1), op=op, group=group, async_op=async_op)


def all_gather(output, input, group, async_op):
    return _all_gather(output.view(-1), input.reshape(-1), group=group, async_op=async_op)


def broadcast(tensor, src, group, async_op):
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_to_all(output, input, output_split_sizes, input_split_sizes, group, async_op):
    return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)


def send(tensor, dst, group, async_op):
    return dist.isend(tensor, dst=dst, group=group) if async_op else dist.send(tensor, dst=dst, group=group)


def recv(tensor, src, group, async_op):
    return dist.irecv(tensor, src=src, group=group) if async_op else dist.recv(tensor, src=src, group=group)


IMPLEMENTATION = {
    "all_reduce": all_reduce,
    "reduce_scatter": reduce_scatter,
    "all_gather": all_gather,
    "broadcast": broadcast,
    "all_to_all": all_to_all,
}
