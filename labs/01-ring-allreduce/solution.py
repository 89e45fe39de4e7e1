"""Lab 01, the reference solution: ring reduce-scatter, all-gather and all-reduce on send/recv.

Self-contained on purpose (the lab stands alone); `toolkit/comm/ring.py` is the same algorithm as the
toolkit uses it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

COMBINE = {
    dist.ReduceOp.SUM: torch.add,
    dist.ReduceOp.PRODUCT: torch.mul,
    dist.ReduceOp.MAX: torch.maximum,
    dist.ReduceOp.MIN: torch.minimum,
}


def ring_of(group=None):
    """(my position r, ring size N, global rank of my left neighbour, global rank of my right neighbour)."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    me = ranks.index(dist.get_rank())
    n = len(ranks)
    return me, n, ranks[(me - 1) % n], ranks[(me + 1) % n]


def pass_along(send: torch.Tensor, receive: torch.Tensor, left: int, right: int, group=None) -> None:
    """One ring step: give `send` to the right neighbour while filling `receive` from the left one."""
    works = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, send, right, group), dist.P2POp(dist.irecv, receive, left, group)]
    )
    for work in works:
        work.wait()


def ring_reduce_scatter(chunks, op, group=None) -> None:
    """In place; afterwards chunk r on rank r is the full reduction. Step s: send chunk r-s-1, get chunk r-s-2."""
    me, n, left, right = ring_of(group)
    for step in range(n - 1):
        outgoing, mine = chunks[(me - step - 1) % n], chunks[(me - step - 2) % n]
        received = torch.empty_like(mine)
        pass_along(outgoing, received, left, right, group)
        COMBINE[op](mine, received, out=mine)


def ring_all_gather(chunks, group=None) -> None:
    """In place; rank r starts with chunk r and ends with all. Step s: send chunk r-s, get chunk r-s-1."""
    me, n, left, right = ring_of(group)
    for step in range(n - 1):
        pass_along(chunks[(me - step) % n], chunks[(me - step - 1) % n], left, right, group)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op, group=None, async_op=False):
    me, n, _, _ = ring_of(group)
    chunks = input.reshape(-1).clone().tensor_split(n)
    ring_reduce_scatter(chunks, op, group)
    output.view(-1).copy_(chunks[me])


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op=False):
    me, n, _, _ = ring_of(group)
    chunks = output.view(-1).tensor_split(n)
    chunks[me].copy_(input.reshape(-1))
    ring_all_gather(chunks, group)


def all_reduce(tensor: torch.Tensor, op, group=None, async_op=False):
    chunks = tensor.view(-1).tensor_split(ring_of(group)[1])
    ring_reduce_scatter(chunks, op, group)
    ring_all_gather(chunks, group)
