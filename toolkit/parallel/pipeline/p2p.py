"""Activations and their gradients between stages: send and receive through `toolkit.comm`, recorded.

Each message is one tensor whose shape the receiver knows before it arrives (the model's `hidden_shape`
for an activation or its gradient, the tied weight's shape), so nothing but the data crosses the wire and
a rank needs no answer from its peer to allocate (what a simulated rank, whose receives complete without
a sender, relies on). Sends are asynchronous (`comm.isend`): a rank hands its output over and goes on.
Receives are posted ahead (`comm.irecv`) and waited for where the data is needed: the "wait" spans on the
trace are time this rank spent blocked, the pipeline's bubble where it shows.

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
    """This rank's point-to-point traffic over the pipeline group, in the per-pair order of `order`.

    From each peer, the receive of the next message it will send is posted ahead (`comm.irecv`), so the data
    can move as soon as the peer sends it, while this rank still computes (as torch's and Megatron's
    schedules post their receives early); `receive` waits for it and posts the one after."""

    def __init__(self, group, me: int, order: dict, shape_of, device):
        self.group, self.me, self.device, self.shape_of = group, me, device, shape_of
        self.ranks = comm.group_ranks(group)  # pipeline rank -> global rank
        self.expected = {src: deque(messages) for (src, dst), messages in order.items() if dst == me}
        self.early: dict = {}  # messages received before they were needed
        self.posted: dict = {}  # peer -> (message, buffer, handle) of the receive posted ahead
        self.pending: list = []  # (handle, tensor) of sends not yet known to be complete
        for peer in self.expected:
            self._post(peer)

    def send(self, message: Message, peer: int, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().contiguous()
        handle = _labelled(lambda: comm.isend(tensor, self.ranks[peer], group=self.group), message)
        self.pending.append((handle, tensor))  # the tensor must live until its send has completed

    def _post(self, peer: int) -> None:
        queue = self.expected.get(peer)
        if queue:
            message = queue.popleft()
            shape, dtype = self.shape_of(message)
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
            handle = _labelled(lambda: comm.irecv(buffer, self.ranks[peer], group=self.group), message)
            self.posted[peer] = (message, buffer, handle)

    def receive(self, message: Message, peer: int) -> torch.Tensor:
        """The tensor of `message` from pipeline rank `peer`; blocks until it is here."""
        if message in self.early:
            return self.early.pop(message)
        while peer in self.posted:
            arrived, buffer, handle = self.posted.pop(peer)
            handle.wait()  # time blocked here is a "wait" span on the trace: the bubble, where it shows
            self._post(peer)
            if arrived == message:
                return buffer
            self.early[arrived] = buffer
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
        unread = list(self.early) + [m for m, _, _ in self.posted.values()] + [m for q in self.expected.values() for m in q]
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
