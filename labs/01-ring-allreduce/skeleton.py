"""Lab 01: ring all-reduce, written by you on point-to-point messages.

Fill in the three functions at the bottom (`reduce_scatter`, `all_gather`, `all_reduce`); the two
helpers above them are given. Grade your work with

    python -m toolkit grade labs/01-ring-allreduce                     # grades this file
    python -m toolkit grade labs/01-ring-allreduce --solution my.py    # or a copy of it

Rules of the game: talk only with `dist.isend` / `dist.irecv` / `dist.batch_isend_irecv` (called as
`dist.something`, so the grader can watch the messages), only to your ring neighbours, and no built-in
collective (`dist.all_reduce` and friends are switched off while the traffic check runs).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# How two partial results combine into one, written in place into the first: COMBINE[op](a, b, out=a).
COMBINE = {
    dist.ReduceOp.SUM: torch.add,
    dist.ReduceOp.PRODUCT: torch.mul,
    dist.ReduceOp.MAX: torch.maximum,
    dist.ReduceOp.MIN: torch.minimum,
}


# --- given: where am I on the ring, and one step of passing along -----------------------------------
def ring_of(group=None):
    """(my position r, ring size N, global rank of my left neighbour, global rank of my right neighbour).

    The group may be a subgroup (ranks [0, 2] of four, say): positions count inside the group, but
    messages are addressed to global ranks, which is what the neighbours are given as.
    """
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    me = ranks.index(dist.get_rank())
    n = len(ranks)
    return me, n, ranks[(me - 1) % n], ranks[(me + 1) % n]


def pass_along(send: torch.Tensor, receive: torch.Tensor, left: int, right: int, group=None) -> None:
    """One ring step: give `send` to the right neighbour while filling `receive` from the left one.

    Both messages are posted before either is awaited: if every rank first did a blocking send, every
    rank would wait for its neighbour to receive, and the ring would deadlock.
    """
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right, group),
                                    dist.P2POp(dist.irecv, receive, left, group)])
    for work in works:
        work.wait()


# --- yours ---------------------------------------------------------------------------------------------
def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op, group=None, async_op=False):
    """Rank r ends with chunk r of the reduction (op over all ranks) of everyone's `input`.

    input has N x output.numel() elements; cut its flat view into N equal chunks. Do not change `input`
    (reduce a copy). N-1 steps: at each, send one chunk to the right, receive one from the left and
    combine it into your copy of that chunk. Return None (`async_op` is ignored: run synchronously).

    Hints:
    - `input.reshape(-1).clone().tensor_split(n)` gives N chunks that are views into one copy.
    - Follow one chunk around the ring. It must *end* at its owner: chunk r's last hop is from rank r-1
      to rank r, at step N-2. So at step s, rank r sends chunk (r - s - 1) mod N. Which one arrives?
    - Receive into a fresh buffer (`torch.empty_like`) and combine: `COMBINE[op](mine, received, out=mine)`.
    - `output.view(-1).copy_(...)` puts the result in place.
    """
    raise NotImplementedError("reduce_scatter: write the N-1 steps of the ring reduce-scatter")


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op=False):
    """Every rank ends with everyone's `input`, concatenated in rank order, in `output`.

    output has N x input.numel() elements. Put your own input in chunk r of output, then N-1 steps:
    send one chunk to the right, receive one from the left, straight into its place in `output`.

    Hints:
    - `output.view(-1).tensor_split(n)` gives views, so receiving into a chunk fills `output`.
    - At step 0 you can only send what you have: chunk r. At step s you send what arrived at step s-1.
    """
    raise NotImplementedError("all_gather: write the N-1 steps of the ring all-gather")


def all_reduce(tensor: torch.Tensor, op, group=None, async_op=False):
    """Every rank ends with the reduction of everyone's `tensor`, in place: reduce-scatter, then all-gather.

    The size need not divide by N: cut `tensor.view(-1)` with `tensor_split(n)` (chunk sizes then differ
    by at most one, and every rank cuts the same way). Work on those chunks in place; you may factor
    the steps of the two functions above into helpers that take a list of chunks.
    Each rank sends 2(N-1)/N of the tensor in all: the grader counts.
    """
    raise NotImplementedError("all_reduce: a reduce-scatter followed by an all-gather, on the same chunks")
