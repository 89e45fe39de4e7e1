"""Lab 04: MoE dispatch and combine over real all-to-alls (the reference solution).

Six pieces are yours (marked "yours" below): `exchange_counts`, `sort_by_destination`, the all-to-all's
`forward` and `backward`, `compute_experts`, `dispatch_compute_combine` and `combine`. Everything else
(the gate, the experts' weights, the helper that moves rows through `toolkit.comm`, and `LabMoE`, which
calls your pieces in order) is given. Read README.md first, then grade your work with

    python -m toolkit grade labs/04-moe-dispatch                     # grades this file
    python -m toolkit grade labs/04-moe-dispatch --solution my.py    # or a copy of it

Rule of the game: rows and counts travel only through `send_rows` (given), so the trace records every
all-to-all with its role ("counts", "dispatch", "combine", and "... backward"), and the grader can read it.
"""

from __future__ import annotations

import torch

from toolkit import comm
from toolkit.moe import MoE, Plan, Routing
from toolkit.moe.experts import Experts
from toolkit.trace.events import recorder


# --- given: one all-to-all of rows, through the toolkit's door, labelled on the timeline ---------------
def send_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, label: str) -> torch.Tensor:
    """Send `in_splits[j]` rows of `x` (along dim 0, in rank order) to rank j; receive `out_splits[j]` from
    rank j. Returns the received rows, rank 0's first. `label` names the call in the trace.

    Both split lists are per rank of `group` and must agree across ranks: what rank i sends to rank j
    (its in_splits[j]) is what rank j expects from rank i (its out_splits[i]).
    """
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    comm.all_to_all(out, x.contiguous(), out_splits, in_splits, group=group)
    if recorder.enabled and recorder.events and recorder.events[-1]["name"] == "all_to_all":
        recorder.events[-1]["args"]["moe"] = label
    return out


# --- yours: 1. who sends how many rows to whom --------------------------------------------------------
def exchange_counts(kept_counts: torch.Tensor, world: int, num_local: int, group):
    """The count exchange. `kept_counts[e]`: rows this rank will send to global expert e (after capacity).

    Expert e lives on rank e // num_local, as its local expert e % num_local. Returns two (world, num_local)
    int64 tensors: send[j, e] = rows this rank sends to rank j's local expert e, and recv[j, e] = rows
    this rank will receive from rank j for its own local expert e. One `send_rows` with label "counts".
    """
    send = kept_counts.reshape(world, num_local)
    split = [num_local] * world
    recv = send_rows(send.reshape(-1), split, split, group, "counts")
    return send, recv.reshape(world, num_local)


# --- yours: 2. line the rows up by destination ---------------------------------------------------------
def sort_by_destination(tokens: torch.Tensor, routing: Routing):
    """Kept (token, choice) pairs in order of expert (then slot), as rows ready to send.

    Returns (order, rows): `order` (long, one entry per kept choice) indexes the flat (T*k) choices,
    so choice c is token c // k's (c % k)-th expert; `rows = tokens[order // k]`. Experts are contiguous
    per rank, so expert order is also destination-rank order. Dropped choices are left out.
    """
    place = routing.buffer_index().reshape(-1)  # expert * C + slot, -1 where dropped
    kept = (place >= 0).nonzero().squeeze(1)
    order = kept[place[kept].argsort()]
    return order, tokens[order // routing.top_k]


# --- yours: 3. an all-to-all that autograd can go back through -----------------------------------------
class AllToAll(torch.autograd.Function):
    """forward: `send_rows(x, out_splits, in_splits, group, label)`. backward: the gradient of each row
    must go back to the rank the row came from."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, label):
        ctx.out_splits, ctx.in_splits, ctx.group, ctx.label = out_splits, in_splits, group, label
        return send_rows(x, out_splits, in_splits, group, label)

    @staticmethod
    def backward(ctx, grad):
        back = send_rows(grad, ctx.in_splits, ctx.out_splits, ctx.group, ctx.label + " backward")
        return back, None, None, None, None


def all_to_all(x, out_splits, in_splits, group, label):
    """Differentiable all-to-all of rows (given: calls your AllToAll)."""
    return AllToAll.apply(x, [int(s) for s in out_splits], [int(s) for s in in_splits], group, label)


# --- yours: 4. the local experts -----------------------------------------------------------------------
def compute_experts(experts: Experts, received: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
    """Run each local expert on its rows. `received` arrives grouped by sender rank, and within each
    sender by local expert: recv_counts[j, e] rows from rank j for expert e. `experts(rows, counts)`
    (given) wants rows grouped by expert (counts[e] rows for expert e, in order). Return one output row
    per received row, in the order `received` came in.
    """
    W, E_local = recv_counts.shape
    expert_of_row = torch.arange(E_local, device=received.device).repeat(W).repeat_interleave(recv_counts.reshape(-1))
    by_expert = expert_of_row.argsort(stable=True)
    out = experts(received[by_expert], recv_counts.sum(0).tolist())
    return out[by_expert.argsort()]


# --- yours: 5. there and back again --------------------------------------------------------------------
def dispatch_compute_combine(
    rows: torch.Tensor, send: torch.Tensor, recv: torch.Tensor, experts: Experts, group
) -> torch.Tensor:
    """Dispatch `rows` (sorted by destination) to the experts' ranks, run the local experts on what arrived,
    and return their outputs to where the rows came from, in the order of `rows`. Two `all_to_all`s,
    labelled "dispatch" and "combine"; split sizes from the count exchange's `send` and `recv`."""
    send_splits, recv_splits = send.sum(1).tolist(), recv.sum(1).tolist()
    received = all_to_all(rows, recv_splits, send_splits, group, "dispatch")
    outputs = compute_experts(experts, received, recv)
    return all_to_all(outputs, send_splits, recv_splits, group, "combine")


# --- yours: 6. the weighted sum ------------------------------------------------------------------------
def combine(answers: torch.Tensor, routing: Routing, order: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """out[t] = sum over token t's kept choices of gate weight x that expert's answer; (num_tokens, d).
    `answers[i]` is the expert output for choice `order[i]`. Must stay differentiable (no in-place writes
    into a tensor autograd needs)."""
    weight = routing.gate_weight.reshape(-1)[order].to(answers.dtype)
    out = answers.new_zeros(num_tokens, answers.shape[-1])
    return out.index_add(0, order // routing.top_k, answers * weight[:, None])


# --- given: the layer, calling your pieces in order ----------------------------------------------------
class LabMoE(MoE):
    """`toolkit.moe.MoE` with your dispatch and combine: the same constructor, the same `(out, aux)`."""

    def forward(self, x: torch.Tensor):
        tokens = x.reshape(-1, self.d_model)
        routing = self.route(tokens)  # the gate (given)
        send, recv = exchange_counts(routing.kept_counts, self.world, self.num_local, self.group)
        order, rows = sort_by_destination(tokens, routing)
        answers = dispatch_compute_combine(rows, send, recv, self.experts, self.group)
        out = combine(answers, routing, order, tokens.shape[0])
        self.record_load(routing, Plan(send, recv))
        return out.reshape(x.shape), routing.loss
