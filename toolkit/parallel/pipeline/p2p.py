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

Under tensor parallelism every rank of a stage's tp group holds the same activation (and the same gradient of
it), so sending it whole from each of them would move the same bytes t times over the link between stages.
Each tp rank sends 1/t of it instead, to its peer of the same tp rank, and the receiving ranks all-gather the
pieces inside their tp group, on the node's fast links (Narayanan et al. 2021, §4.1, the scatter/gather
optimisation; Megatron-LM had it on by default). Under sequence parallelism the activation between stages is
already split (each rank's s/t positions, all that its peer needs), so it is sent as it is, which is why
Megatron-core has since dropped the switch. Messages whose size does not divide by t go whole. `receive`
hands over what arrived; the action that uses it makes it `whole`.
"""

from __future__ import annotations

import math
from collections import deque

import torch

from ... import comm
from ..tensor.operators import labelled
from .lowering import Message


class Mailbox:
    """This rank's point-to-point traffic over the pipeline group, in the per-pair order of `order`.

    From each peer, the receive of the next message it will send is posted ahead (`comm.irecv`), so the data
    can move as soon as the peer sends it, while this rank still computes (as torch's and Megatron's
    schedules post their receives early); `receive` waits for it and posts the one after."""

    def __init__(self, group, me: int, order: dict, shape_of, device, split=None):
        self.group, self.me, self.device, self.shape_of = group, me, device, shape_of
        self.split = split if split is not None and split.size > 1 else None  # the TPGroup whose ranks share 1/t each
        self.ranks = comm.group_ranks(group)  # pipeline rank -> global rank
        self.expected = {src: deque(messages) for (src, dst), messages in order.items() if dst == me}
        self.early: dict = {}  # messages received before they were needed
        self.posted: dict = {}  # peer -> (message, buffer, handle) of the receive posted ahead
        self.pending: list = []  # (handle, tensor) of sends not yet known to be complete
        for peer in self.expected:
            self._post(peer)

    def send(self, message: Message, peer: int, tensor: torch.Tensor, within: bool = False) -> None:
        """Send `message` to pipeline rank `peer`, asynchronously. within: issued from inside the action that
        made it (a backward's input gradient, `driver.py`), which its span says."""
        tensor = tensor.detach().contiguous()
        if self._scattered(message, tensor.shape):  # this tp rank's 1/t of it (a contiguous view of the flat tensor)
            tensor = tensor.view(-1).chunk(self.split.size)[self.split.rank]
        handle = _labelled(lambda: comm.isend(tensor, self.ranks[peer], group=self.group), message, within)
        self.pending.append((handle, tensor))  # the tensor must live until its send has completed

    def _post(self, peer: int) -> None:
        queue = self.expected.get(peer)
        if queue:
            message = queue.popleft()
            shape, dtype = self.shape_of(message)
            if self._scattered(message, shape):
                shape = (math.prod(shape) // self.split.size,)
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
        raise RuntimeError(
            f"pipeline: rank {self.me} waits for the {message!r} from rank {peer}, which never sends it "
            f"(a schedule lowered without it: a bug in toolkit.parallel.pipeline)."
        )

    def _scattered(self, message: Message, shape) -> bool:
        """Whether `message` crosses in 1/t pieces: an activation or its gradient, the same on every tp rank."""
        return (
            self.split is not None
            and message.kind in ("activation", "gradient")
            and math.prod(shape) % self.split.size == 0
        )

    def whole(self, message: Message, buffer: torch.Tensor) -> torch.Tensor:
        """The message as its receiver uses it: a piece all-gathered with the tp group's other pieces, reshaped
        (called by the action that uses it, so the gather is that action's work on every rank alike)."""
        shape, _ = self.shape_of(message)
        if not self._scattered(message, shape):
            return buffer
        pieces = buffer.new_empty((self.split.size,) + tuple(buffer.shape))
        labelled(lambda: comm.all_gather(pieces, buffer, group=self.split.group), f"pipeline {message.kind} all-gather")
        return pieces.view(shape)

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
        unread = (
            list(self.early) + [m for m, _, _ in self.posted.values()] + [m for q in self.expected.values() for m in q]
        )
        if unread:
            raise RuntimeError(f"pipeline: rank {self.me} was sent {unread[:3]} but never used them.")


def _labelled(call, message: Message, within: bool = False):
    """Run one send or receive through the door and say on its span what it carried (and `within`: that it left
    from inside the action that made it)."""
    issued = []
    with comm.listening(lambda kind, event, tensor: issued.append(event) if kind == "issue" else None):
        result = call()
    for event in issued:
        event["args"].update(message=message.kind, micro=message.micro, stage=message.stage)
        if within:
            event["args"]["within"] = True
    return result
