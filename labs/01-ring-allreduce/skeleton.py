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
    rank would wait for its neighbour to receive, and the ring would deadlock. Tensors of any size work,
    empty ones (0 elements, as `tensor_split` makes when there are fewer elements than ranks) included, as
    long as `send` here has the size of `receive` on the right neighbour.
    """
    works = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, send, right, group), dist.P2POp(dist.irecv, receive, left, group)]
    )
    for work in works:
        work.wait()


# --- yours ---------------------------------------------------------------------------------------------
def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op, group=None, async_op=False):
    """Rank r ends with chunk r of the reduction (`op` over all ranks) of everyone's `input`, in `output`.

    Shapes: `input` has N x output.numel() elements; its flat view cut into N equal chunks, chunk j belongs to rank
    j. `input` is left unchanged. Return None (`async_op` is ignored: run synchronously).

    The ring (README, "The ring"): N-1 steps; at each, every rank sends one chunk to its right neighbour and
    receives one from its left, and combines what arrives into its own copy of that chunk, so that each chunk picks
    up one rank's contribution per hop and its last hop lands on its owner. Every rank sends (N-1)/N of the tensor.
    `COMBINE[op]` combines two partial results; `pass_along` is one step.
    """
    raise NotImplementedError("reduce_scatter: not written yet")


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op=False):
    """Every rank ends with everyone's `input`, concatenated in rank order, in `output` (N x input.numel() elements:
    block j is rank j's input). N-1 ring steps: each forwards one block to the right neighbour and receives one from
    the left, straight into its place; every rank sends (N-1)/N of the output.
    """
    raise NotImplementedError("all_gather: not written yet")


def all_reduce(tensor: torch.Tensor, op, group=None, async_op=False):
    """Every rank ends with the reduction of everyone's `tensor`, in place: a reduce-scatter, then an all-gather of the
    finished chunks (2(N-1) steps, 2(N-1)/N of the tensor sent per rank: the grader counts).

    The size need not divide by N: every rank must cut the tensor the same way, into N chunks whose sizes differ by
    at most one (`tensor_split`), and a ring of one rank (N = 1) moves nothing. It must work on a subgroup too:
    positions count inside the group, messages go to global ranks (`ring_of`).
    """
    raise NotImplementedError("all_reduce: not written yet")
