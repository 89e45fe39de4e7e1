"""All-to-all by pairwise exchange, written on point-to-point send/recv (FasterMoE's schedule).

Why: in an all-to-all every rank has a block for every other rank (an MoE layer's tokens for each
expert's owner). Sending all blocks at once makes N-1 senders collide on every receiver's link.
Pairwise exchange spreads them over N steps instead: at step i rank j sends to (j - i) mod N and
receives from (j + i) mod N, so each step is a perfect matching (every rank sends exactly one block
and receives exactly one), and step 0 is the local copy of the block a rank keeps.

Blocks are rows along dim 0 and may be uneven, even empty (an expert nobody routed to). The function
has the signature of `toolkit.comm.backend.all_to_all`; `toolkit.comm.use("ring")` plugs it in.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def pairwise_schedule(rank: int, n: int) -> list[tuple[int, int]]:
    """The (send_to, recv_from) positions of `rank` at steps 0..n-1; step 0 is (rank, rank)."""
    return [((rank - step) % n, (rank + step) % n) for step in range(n)]


def exchange(send: torch.Tensor, send_to: int, receive: torch.Tensor, recv_from: int, group=None) -> None:
    """One step: send one block and receive one block at the same time (empty blocks travel too, so
    every rank takes part in every step)."""
    works = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, send, send_to, group), dist.P2POp(dist.irecv, receive, recv_from, group)]
    )
    for work in works:
        work.wait()


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes=None,
    input_split_sizes=None,
    group=None,
    async_op=False,
):
    """Block j of my `input` goes to position j; block i of my `output` comes from position i.

    Split sizes count rows along dim 0 (None: equal blocks). Runs synchronously; `async_op` is ignored.
    """
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    me, n = ranks.index(dist.get_rank()), len(ranks)
    in_splits = [input.shape[0] // n] * n if input_split_sizes is None else list(input_split_sizes)
    out_splits = [output.shape[0] // n] * n if output_split_sizes is None else list(output_split_sizes)
    outgoing, incoming = input.split(in_splits), output.split(out_splits)
    for send_to, recv_from in pairwise_schedule(me, n):
        if send_to == me:
            incoming[me].copy_(outgoing[me])  # step 0: the block I keep never leaves
        else:
            exchange(outgoing[send_to], ranks[send_to], incoming[recv_from], ranks[recv_from], group)


IMPLEMENTATION = {"all_to_all": all_to_all}
