"""Lab 04: MoE dispatch and combine over real all-to-alls, written by you.

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
    """The count exchange: before any row moves, every rank must know how many rows it will receive from each rank for
    each of its experts (the all-to-all of rows needs both sides' split sizes to agree).

    `kept_counts[e]`: rows this rank will send to global expert e (after capacity). Expert e lives on rank e //
    num_local, as its local expert e % num_local. Returns two (world, num_local) int64 tensors: send[j, e] = rows
    this rank sends to rank j's local expert e; recv[j, e] = rows this rank receives from rank j for its own local
    expert e. One `send_rows` labelled "counts" (the trace check counts it).
    """
    raise NotImplementedError("exchange_counts: not written yet")


# --- yours: 2. line the rows up by destination ---------------------------------------------------------
def sort_by_destination(tokens: torch.Tensor, routing: Routing):
    """Line the kept (token, choice) pairs up as rows ready to send: grouped by expert in increasing order (experts are
    contiguous per rank, so that is also destination-rank order), and within an expert in slot order. Dropped
    choices are left out.

    Returns (order, rows): `order` is a 1-D long tensor with one entry per kept choice, each a flat index c into the
    T*k choices (choice c is token c // k's (c % k)-th expert); `rows[i]` is the token of choice `order[i]`.
    `routing.buffer_index()` says, per (token, choice), where the gate put it (expert * capacity + slot), or -1.
    """
    raise NotImplementedError("sort_by_destination: not written yet")


# --- yours: 3. an all-to-all that autograd can go back through -----------------------------------------
class AllToAll(torch.autograd.Function):
    """forward: `send_rows(x, out_splits, in_splits, group, label)`. backward: the gradient of each row
    must go back to the rank the row came from."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, label):
        """Move the rows with `send_rows` (rows to rank j: in_splits[j]; from rank j: out_splits[j]), keeping on `ctx`
        what backward will need to send the gradients home.
        """
        raise NotImplementedError("AllToAll.forward: not written yet")

    @staticmethod
    def backward(ctx, grad):
        """`grad` has one row per row this rank *received*: each row's gradient must go back to the rank that sent the
        row, in the order that rank sent it. Label the exchange ctx.label + " backward". Return one gradient per
        input of forward (None for the splits, the group and the label).
        """
        raise NotImplementedError("AllToAll.backward: not written yet")


def all_to_all(x, out_splits, in_splits, group, label):
    """Differentiable all-to-all of rows (given: calls your AllToAll)."""
    return AllToAll.apply(x, [int(s) for s in out_splits], [int(s) for s in in_splits], group, label)


# --- yours: 4. the local experts -----------------------------------------------------------------------
def compute_experts(experts: Experts, received: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
    """Run each local expert on its rows. `received` arrives grouped by sender rank, and within each sender by local
    expert: recv_counts[j, e] rows from rank j for local expert e. `experts(rows, counts)` (given) wants rows
    grouped by expert (counts[e] rows for expert e, experts in order). Return one output row per received row, in
    the order `received` came in: the combine sends them back in that order.
    """
    raise NotImplementedError("compute_experts: not written yet")


# --- yours: 5. there and back again --------------------------------------------------------------------
def dispatch_compute_combine(
    rows: torch.Tensor, send: torch.Tensor, recv: torch.Tensor, experts: Experts, group
) -> torch.Tensor:
    """Dispatch `rows` (sorted by destination) to the experts' ranks, run the local experts on what arrived, and return
    their outputs to where the rows came from, in the order of `rows`: two differentiable all-to-alls, labelled
    "dispatch" and "combine", with the split sizes the count exchange gave (`send`, `recv`: rows per destination
    rank and per local expert).
    """
    raise NotImplementedError("dispatch_compute_combine: not written yet")


# --- yours: 6. the weighted sum ------------------------------------------------------------------------
def combine(answers: torch.Tensor, routing: Routing, order: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """out[t] = the sum over token t's kept choices of (its gate weight x that expert's answer); shape (num_tokens, d).
    `answers[i]` is the expert output for choice `order[i]`; `routing.gate_weight` is (T, k). A dropped choice adds
    nothing. The result must stay differentiable with respect to the answers *and* the gate weights (the router
    learns through it): no in-place write into a tensor autograd needs.
    """
    raise NotImplementedError("combine: not written yet")


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
