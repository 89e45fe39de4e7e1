"""The ring: the cp ranks in a circle, each passing a block on to the next while it computes on the one it has.

Rank i sends to rank i+1 and receives from rank i-1 (mod cp). After cp-1 passes every block has visited every
rank, and at every moment each link carries one block in one direction: the per-rank traffic does not grow
with cp, and it is point to point between neighbours only (on a node, NVLink; the pairs of a ring cross the
network once per hop at most).

A pass is started, not finished: `pass_on` posts the send and the receive (`toolkit.comm.isend`/`irecv`, so both
are recorded on the trace) and returns at once; the caller computes on the block it holds and calls `wait()`
for the next one only when it needs it. That is the overlap of ring attention: the next block's transfer hides
behind this block's attention, as long as a block's attention takes longer than its transfer. Tensor parallelism's
`tp_comm_overlap` runs its rings on the same class, over the tp group, its passes labelled `args["tp"]`
(`toolkit/parallel/tensor/overlap.py`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ... import comm
from .operators import labelled


class Ring:
    """The context-parallel group as a ring: this rank's neighbours, as global ranks."""

    def __init__(self, group, key: str = "cp"):
        self.group, self.key = group, key  # key: the span arg that names its passes (`operators.labelled`)
        self.ranks = comm.group_ranks(group)
        self.size = len(self.ranks)
        self.rank = self.ranks.index(dist.get_rank())
        self.next = self.ranks[(self.rank + 1) % self.size]
        self.previous = self.ranks[(self.rank - 1) % self.size]

    def source(self, step: int) -> int:
        """The ring index of the rank whose block this rank holds after `step` passes."""
        return (self.rank - step) % self.size

    def pass_on(self, block: torch.Tensor, label: str = "kv") -> Pass:
        """Send `block` to the next rank and receive the previous rank's block of the same shape, asynchronously.
        Even ranks post the send first, odd ranks the receive (so no two neighbours wait on each other's send,
        on any backend)."""
        block = block.contiguous()
        incoming = torch.empty_like(block)
        send = lambda: comm.isend(block, self.next, group=self.group)  # noqa: E731
        receive = lambda: comm.irecv(incoming, self.previous, group=self.group)  # noqa: E731
        calls = (send, receive) if self.rank % 2 == 0 else (receive, send)
        handles = labelled(calls, label, self.key)
        return Pass(handles, block, incoming)


class Pass:
    """A block on its way: `wait()` returns the block received from the previous rank."""

    def __init__(self, handles, sent, incoming):
        self.handles, self.sent, self.incoming = handles, sent, incoming

    def wait(self) -> torch.Tensor:
        for handle in self.handles:  # the send too: its buffer may be reused only when it has gone
            handle.wait()
        self.sent = None
        return self.incoming
