"""Ring all-reduce, reduce-scatter and all-gather, written on point-to-point send/recv.

Why a ring: put the N ranks of a group in a circle and cut the tensor into N chunks. At every step each
rank passes one chunk to its right neighbour while it takes one from its left neighbour, so every link
is busy and no rank is a bottleneck.

- reduce-scatter: N-1 steps; each chunk travels once around the ring, picking up one rank's
  contribution per hop, and ends at its owner (rank r owns chunk r) fully reduced.
- all-gather: N-1 steps; each owner's chunk travels once around the ring, copied as it goes.
- all-reduce = reduce-scatter, then all-gather.

Each rank sends (N-1)/N of the tensor in a reduce-scatter or an all-gather, so 2(N-1)/N in an
all-reduce: almost the same bytes for 4 ranks or 4,000, which is why NCCL uses rings.

The functions have the signatures of `toolkit.comm.backend`; `toolkit.comm.use("ring")` plugs them
into the toolkit's collectives. They run synchronously (`async_op` is ignored) and talk through raw
`torch.distributed`, so the door records one collective, not its messages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# How two partial results combine into one, for each reduction (written in place into the first).
COMBINE = {
    dist.ReduceOp.SUM: torch.add,
    dist.ReduceOp.PRODUCT: torch.mul,
    dist.ReduceOp.MAX: torch.maximum,
    dist.ReduceOp.MIN: torch.minimum,
}


def ring_of(group=None):
    """(my position, ring size, global rank of my left neighbour, global rank of my right neighbour)."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    me = ranks.index(dist.get_rank())
    n = len(ranks)
    return me, n, ranks[(me - 1) % n], ranks[(me + 1) % n]


def pass_along(send: torch.Tensor, receive: torch.Tensor, left: int, right: int, group=None) -> None:
    """One ring step: give `send` to the right neighbour while filling `receive` from the left one.

    Both messages are posted before either is awaited; a blocking send first would deadlock the ring
    (every rank would wait for its neighbour to receive).
    """
    works = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, send, right, group), dist.P2POp(dist.irecv, receive, left, group)]
    )
    for work in works:
        work.wait()


def ring_reduce_scatter(chunks: list[torch.Tensor], op, group=None) -> None:
    """Reduce `chunks` around the ring, in place: afterwards chunk r on rank r holds the full reduction.

    Step s (0..N-2): send chunk (r - s - 1) mod N to the right, receive chunk (r - s - 2) mod N from the
    left and combine it into ours. (Many lectures start by sending chunk r and end owning chunk r + 1;
    this is the same ring shifted by one, so that rank r ends with chunk r, as `reduce_scatter` promises.)
    Chunks other than chunk r are left partially reduced.
    """
    if op not in COMBINE:
        raise ValueError(f"the ring supports op in {[str(o) for o in COMBINE]}, got {op}.")
    combine = COMBINE[op]
    me, n, left, right = ring_of(group)
    for step in range(n - 1):
        outgoing = chunks[(me - step - 1) % n]
        ours = chunks[(me - step - 2) % n]
        incoming = torch.empty_like(ours)
        pass_along(outgoing, incoming, left, right, group)
        combine(ours, incoming, out=ours)


def ring_all_gather(chunks: list[torch.Tensor], group=None) -> None:
    """Circulate the chunks, in place: rank r starts with chunk r, every rank ends with all of them.

    Step s (0..N-2): send chunk (r - s) mod N to the right, receive chunk (r - s - 1) mod N from the left.
    """
    me, n, left, right = ring_of(group)
    for step in range(n - 1):
        pass_along(chunks[(me - step) % n], chunks[(me - step - 1) % n], left, right, group)


# --- the three collectives, with the backend's signatures ------------------------------------------
def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op, group=None, async_op=False):
    """Rank r gets chunk r of the reduction of everyone's `input` (input has N x output's elements)."""
    me, n, _, _ = ring_of(group)
    chunks = input.reshape(-1).clone().tensor_split(n)  # a copy: the caller's input stays as it was
    ring_reduce_scatter(chunks, op, group)
    output.view(-1).copy_(chunks[me])


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op=False):
    """Every rank gets everyone's `input`, concatenated in rank order (output has N x input's elements)."""
    me, n, _, _ = ring_of(group)
    chunks = output.view(-1).tensor_split(n)
    chunks[me].copy_(input.reshape(-1))
    ring_all_gather(chunks, group)


def all_reduce(tensor: torch.Tensor, op, group=None, async_op=False):
    """Every rank gets the reduction of everyone's `tensor`, in place: reduce-scatter, then all-gather.

    Any size works: `tensor_split` cuts the flat tensor into N chunks whose sizes differ by at most one.
    """
    n = ring_of(group)[1]
    chunks = tensor.view(-1).tensor_split(n)  # views: the ring writes straight into `tensor`
    ring_reduce_scatter(chunks, op, group)  # now rank r holds the reduced chunk r
    ring_all_gather(chunks, group)  # now every rank holds every reduced chunk


IMPLEMENTATION = {"all_reduce": all_reduce, "reduce_scatter": reduce_scatter, "all_gather": all_gather}
