"""One step of a pipeline on this rank: run its program (`lowering.py`), action by action.

    F(i, s)  stage s's forward on micro-batch i: the token ids (first stage) or the activation received;
             keep what backward needs (the autograd graph), send the output on
    B(i, s)  backward from the gradient received (last stage: from the loss / m); send the input's
             gradient back the moment autograd has it, from inside the backward: before the data-parallel
             strategy's end of backward waits for its reductions (below). Split schedules (ZB-H1): the
             input's gradient only (`backward.py`)...
    W(i, s)  ...and the weights' gradients later
    Recv / Send  through the mailbox (`p2p.py`)

Gradients accumulate over the micro-batches, so one step is the whole batch's: each micro-batch's loss
enters backward divided by m. The data-parallel strategy of each stage reduces once, in the stage's last
weight-gradient action (the others run inside its `no_sync()`, where it has one: DDP, ZeRO-1 and FSDP
accumulate locally; ZeRO-2/3 reduce-scatter every micro-batch, since they keep only a slice).
A data-parallel strategy waits for its reductions at the end of the backward in which it reduces (DDP's
buckets, FSDP's and ZeRO-2/3's reduce-scatters), which is where autograd calls it back. A gradient sent after
that waits for them too, and the stage upstream with it: in the cool-down each stage's last backward would pass
its reduction's time on to the next, pp reductions in a row on the critical path. Megatron-LM never holds a
send behind a reduction (2021: local DDP all-reduces after the whole schedule, `train_step`; Megatron-core:
`finalize_model_grads` waits after it), so the gradient leaves from a hook on the input's accumulation,
inside the backward, and the reduction's wait delays only this rank.
The returned loss is the batch's mean on every rank of the pipeline: the last stage's losses plus every
stage's auxiliary losses (MoE), summed over the pipeline group by one small all-reduce, issued after the
rank's last forward so that it runs behind the backwards still to do.
"""

from __future__ import annotations

import contextlib

import torch

from ... import comm
from ...trace.events import phase, span
from . import backward as bw
from .lowering import Recv, Send
from .p2p import Mailbox
from .schedules import KINDS, Action


class Driver:
    """What a rank needs to run its program: its stages (wrapped by the data-parallel strategy), the program,
    the message order, the pipeline group, and the shapes of what it receives."""

    def __init__(
        self,
        stages: dict,
        program: list,
        order: dict,
        group,
        me: int,
        microbatches: int,
        stages_total: int,
        *,
        split: bool,
        tie,
        hidden_shape,
        dtype,
        device,
        scatter=None,
    ):
        self.stages, self.program, self.order = stages, program, order
        self.scatter = scatter  # the TPGroup whose ranks send 1/t of each activation (`p2p.py`), or None
        self.group, self.me, self.m, self.split = group, me, microbatches, split
        self.last_stage = stages_total - 1
        self.tie, self.hidden_shape, self.dtype, self.device = tie, hidden_shape, dtype, device
        weight_kind = "W" if split else "B"
        self.reduces = {
            s: next(a for a in reversed(program) if isinstance(a, Action) and a.kind == weight_kind and a.stage == s)
            for s in stages
        }  # the action in which each stage reduces
        # this rank's share of the loss is complete after its last forward: its sum over the pipeline starts
        # then and runs behind the backwards still to do
        self.last_forward = max(i for i, op in enumerate(program) if isinstance(op, Action) and op.kind == "F")
        # the send of each backward's input gradient, issued from inside that backward (not under split schedules,
        # whose B computes input gradients only: nothing waits in it)
        self.sends_within = (
            {}
            if split
            else {
                op: after
                for op, after in zip(program, program[1:])
                if isinstance(op, Action)
                and op.kind == "B"
                and isinstance(after, Send)
                and after.message == (("gradient", op.micro, op.stage))
            }
        )
        # each stage's units start gathering one action before its first forward of the step, or before the step's
        # first message where that forward comes first (`unshard_ahead`: FSDP; other strategies gather in forward)
        self.unshard_before: dict = {}
        actions = [i for i, op in enumerate(program) if isinstance(op, Action)]
        for s in stages:
            first = next(k for k, i in enumerate(actions) if program[i].kind == "F" and program[i].stage == s)
            self.unshard_before.setdefault(actions[first - 1] if first else None, []).append(s)
        self.observers: list = []  # fn(action) after every action (a memory sample, a probe)
        self.calls = 0  # steps run so far: the step its spans are labelled with

    def run(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        # each micro-batch its own tensors, as a data loader gives them (views of one batch would share a storage
        # that autograd keeps for every micro-batch at once: the token ids the embedding and the loss save)
        xs, ys = [c.clone() for c in x.chunk(self.m)], [c.clone() for c in y.chunk(self.m)]
        micro_shape = tuple(xs[0].shape)
        shapes = {"activation": self.hidden_shape(micro_shape), "gradient": self.hidden_shape(micro_shape)}
        if self.tie is not None:
            shapes["tied weight"] = shapes["tied gradient"] = self.tie.shape
        self.mailbox = mailbox = Mailbox(
            self.group, self.me, self.order, lambda msg: (shapes[msg.kind], self.dtype), self.device, split=self.scatter
        )
        self.kept: dict = {}  # (micro, stage) -> [input, roots, gradients of the roots, W's groups]
        self.sent_within: set = set()  # the Sends already issued from inside their backward
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.tie is not None and 0 in self.stages:
            self.tie.capture = True
        self._unshard_ahead(None)
        for index, op in enumerate(self.program):
            if isinstance(op, Recv):
                self._received(op.message, mailbox.receive(op.message, op.peer))
            elif isinstance(op, Send):
                if op not in self.sent_within:
                    mailbox.send(op.message, op.peer, self._outgoing(op.message))
            else:
                self._unshard_ahead(index)
                with phase("forward" if op.kind == "F" else "backward"):
                    with span(KINDS[op.kind], step=self.calls - 1, micro=op.micro, stage=op.stage, action=op.kind):
                        if op.kind == "F":
                            total += self._forward(op, xs, ys)
                        else:
                            self._backward(op)
                if index == self.last_forward:
                    with phase("pipeline loss"):  # the last stage's losses + every stage's aux losses
                        summed = comm.all_reduce(total, group=self.group, async_op=True)
                mailbox.reap()
                for observe in self.observers:
                    observe(op)
        mailbox.finish()
        self.mailbox = None
        if self.tie is not None:
            self.tie.outgoing = None
            if self.tie.borrowed is not None:
                self.tie.borrowed.grad = None
        summed.wait()
        return total / self.m

    # --- the actions -----------------------------------------------------------------------------------
    def _unshard_ahead(self, index) -> None:
        for s in self.unshard_before.get(index, ()):
            if hasattr(self.stages[s], "unshard_ahead"):
                self.stages[s].unshard_ahead()

    def _forward(self, op: Action, xs, ys) -> torch.Tensor:
        first, last = op.stage == 0, op.stage == self.last_stage
        inputs = xs[op.micro] if first else self._arrived((op.micro, op.stage, "input")).requires_grad_()
        out = self.stages[op.stage](inputs, ys[op.micro] if last else None)
        if last:
            roots, extra = [out / self.m], out
        else:
            h, extra = out
            self.kept[(op.micro, op.stage, "output")] = h
            roots = [h] + ([extra / self.m] if extra is not None else [])
        self.kept[(op.micro, op.stage)] = [inputs, roots, None, None]
        return extra.detach().float() if extra is not None else torch.zeros((), device=self.device)

    def _backward(self, op: Action) -> None:
        entry = self.kept[(op.micro, op.stage)]
        inputs, roots = entry[0], entry[1]
        if op.kind == "B":  # the loss's gradient is 1 (None); a stage's output's came from the next stage
            entry[2] = (
                [None]
                if op.stage == self.last_stage
                else [self._arrived((op.micro, op.stage, "gradient"))] + [None] * (len(roots) - 1)
            )
        send = self.sends_within.get(op)
        hook = (
            None
            if send is None
            else inputs.register_post_accumulate_grad_hook(lambda t: self._send_within(send, t.grad))
        )
        with self._sync(op):
            if not self.split:
                bw.backward(roots, entry[2])
            elif op.kind == "B" and op.stage > 0:  # input gradients now, weights' later (the borrowed tied
                leaves = [inputs]  # weight's with the input's: it is sent back after the last B)
                if op.stage == self.last_stage and self.tie is not None and self.tie.borrowed is not None:
                    leaves.append(self.tie.borrowed)
                weights = [p for p in self.stages[op.stage].parameters() if p.requires_grad]
                entry[3] = bw.backward_input(roots, entry[2], leaves, weights)
            elif op.kind == "W" and op.stage == 0:  # token ids have no gradient: B did nothing, W does it all
                bw.backward(roots, entry[2])
            elif op.kind == "W":
                bw.backward_weight(entry[3])
        if hook is not None:
            hook.remove()
            if send not in self.sent_within:
                raise RuntimeError(f"pipeline: the backward {op!r} gave its input no gradient to send back.")
        elif op.kind == "B" and op.stage > 0:
            self.kept[(op.micro, op.stage, "input gradient")] = inputs.grad
        if op.kind == ("W" if self.split else "B"):
            del self.kept[(op.micro, op.stage)]

    def _sync(self, op: Action):
        """Inside the stage strategy's no_sync() unless this is the stage's last weight-gradient action (DDP
        decides at forward time, which a schedule cannot: it is told at backward time instead)."""
        wrapped, reduce = self.stages[op.stage], op == self.reduces[op.stage]
        if hasattr(wrapped, "sync_backward"):
            return wrapped.sync_backward(reduce)
        if reduce or not hasattr(wrapped, "no_sync"):
            return contextlib.nullcontext()
        return wrapped.no_sync()

    def _send_within(self, send: Send, gradient: torch.Tensor) -> None:
        """The input's gradient is complete: send it now, while the strategy's hooks may still wait."""
        self.mailbox.send(send.message, send.peer, gradient, within=True)
        self.sent_within.add(send)

    # --- messages --------------------------------------------------------------------------------------
    def _received(self, message, tensor: torch.Tensor) -> None:
        if message.kind == "activation":
            self.kept[(message.micro, message.stage + 1, "input")] = (message, tensor)
        elif message.kind == "gradient":
            self.kept[(message.micro, message.stage - 1, "gradient")] = (message, tensor)
        elif message.kind == "tied weight":
            with torch.no_grad():
                self.tie.borrowed.copy_(tensor)
        else:
            self.tie.incoming = tensor

    def _arrived(self, key) -> torch.Tensor:
        """An activation or gradient received for this action, made whole (under tp: its pieces all-gathered)."""
        message, tensor = self.kept.pop(key)
        return self.mailbox.whole(message, tensor)

    def _outgoing(self, message) -> torch.Tensor:
        if message.kind == "activation":
            return self.kept.pop((message.micro, message.stage, "output"))
        if message.kind == "gradient":
            return self.kept.pop((message.micro, message.stage, "input gradient"))
        if message.kind == "tied weight":
            return self.tie.outgoing
        return self.tie.borrowed.grad
