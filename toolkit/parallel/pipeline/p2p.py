"""Activations and their gradients between stages: send and receive through `toolkit.comm`, recorded.

Each message is one tensor whose shape the receiver knows before it arrives (the model's `hidden_shape`
for an activation or its gradient, the tied weight's shape), so nothing but the data crosses the wire and
a rank needs no answer from its peer to allocate (what a simulated rank, whose receives complete without
a sender, relies on). Sends are asynchronous (`comm.isend`): a rank hands its output over and goes on.
A receive blocks until its data is there (`comm.recv`); its span on the trace is time this rank spent
waiting, the pipeline's bubble where it shows.

Between two ranks, messages are received in the order they were sent (what NCCL does; `lowering.py`).
When a rank needs a later message first (the interleaved schedule at pp = 2, where activations and
gradients share a pair of ranks), it receives the earlier ones into its mailbox on the way.
Every span says what it carried: args message ("activation", "gradient", "tied weight", "tied gradient"),
micro, stage (the stage that produced it), so a timeline can draw the arrow and a simulator pair the two ends.
"""
from __future__ import annotations

from collections import deque

import torch

from ... import comm
from .lowering import Message


class Mailbox:
    """This rank's point-to-point traffic over the pipeline group, in the per-pair order of `order`."""

    def __init__(self, group, me: int, order: dict, shape_of, device):
        self.group, self.me, self.device, self.shape_of = group, me, device, shape_of
        self.ranks = comm.group_ranks(group)  # pipeline rank -> global rank
        self.expected = {src: deque(messages) for (src, dst), messages in order.items() if dst == me}
        self.early: dict = {}  # messages received before they were needed
        self.pending: list = []  # (handle, tensor) of sends not yet known to be complete

    def send(self, message: Message, peer: int, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().contiguous()
        handle = _labelled(lambda: comm.isend(tensor, self.ranks[peer], group=self.group), message)
        self.pending.append((handle, tensor))  # the tensor must live until its send has completed

    def receive(self, message: Message, peer: int) -> torch.Tensor:
        """The tensor of `message` from pipeline rank `peer`; blocks until it is here."""
        if message in self.early:
            return self.early.pop(message)
        queue = self.expected.get(peer)
        while queue:
            nxt = queue.popleft()
            shape, dtype = self.shape_of(nxt)
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
            _labelled(lambda: comm.recv(buffer, self.ranks[peer], group=self.group), nxt)
            if nxt == message:
                return buffer
            self.early[nxt] = buffer
        raise RuntimeError(f"pipeline: rank {self.me} waits for the {message!r} from rank {peer}, which never sends it "
                           f"(a schedule lowered without it: a bug in toolkit.parallel.pipeline).")

    def reap(self) -> None:
        """Let go of the sends that have completed (so a sent activation is not kept to the step's end)."""
        still = []
        for handle, tensor in self.pending:
            if handle.is_completed():
                handle.wait()
            else:
                still.append((handle, tensor))
        self.pending = still

    def finish(self) -> None:
        """Wait for every send still in flight (the step's end), and check nothing was left unread."""
        for handle, _ in self.pending:
            handle.wait()
        self.pending = []
        unread = list(self.early) + [m for q in self.expected.values() for m in q]
        if unread:
            raise RuntimeError(f"pipeline: rank {self.me} was sent {unread[:3]} but never used them.")


def _labelled(call, message: Message):
    """Run one send or receive through the door and say on its span what it carried."""
    issued = []
    with comm.listening(lambda kind, event, tensor: issued.append(event) if kind == "issue" else None):
        result = call()
    for event in issued:
        event["args"].update(message=message.kind, micro=message.micro, stage=message.stage)
    return result
