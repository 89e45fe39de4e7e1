"""Switchable parallelism for the expert weights (Tutel): move the tokens, or move the weights.

Expert parallelism ("ep") leaves each expert on its owner and sends the tokens there and back: four
all-to-alls per training step (dispatch, combine, and both again in backward), whose size grows with
the tokens routed (Tutel's C_g). Data parallelism ("dp") does the opposite: every rank gets a copy of
every expert for the step and computes its own tokens with them; no token travels, the weights do:
an all-gather of the experts in forward and, in backward, a reduce-scatter that brings each expert's
gradient, summed over the ranks, back to its owner. That is O(P) bytes for P expert parameters,
whatever the load. Tutel's table: DP O(P), EP+DP O(C_g + P/E). Here every expert has exactly one
owner (E is a multiple of the world size), so the P/E term, the all-reduce among an expert's
replicas, is zero and EP costs O(C_g).

The switch costs nothing (Tutel's point): storage is the expert-parallel layout in both cases (rank r
keeps experts r*E/W .. (r+1)*E/W - 1, its optimizer state too), so "dp" is a way of running a step,
not another model: all-gather + reduce-scatter is exactly an all-reduce of the gradients that skips
the all-gather no rank needs. That lets ``expert_parallel="auto"`` choose per layer and per forward
from the communication model: the bytes each would put on the wire for the rows actually routed
(one all-reduce MAX of one number so every rank sees the busiest rank's rows and all decide alike).
The choice and its reason are kept in ``placement.choice`` / ``placement.reason`` and recorded as
``moe/{name}/parallel``. Outputs and gradients are the same either way.

Note the kinship with shadowing (moe/shadow.py): "dp" is shadowing every expert, with the per-expert
broadcasts and gradient reductions batched into one all-gather and one reduce-scatter.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import comm
from ..trace.events import recorder, span
from .load import enclosing_step
from .machine import _label
from .plan import Plan

MODES = ("ep", "dp", "auto")


# --- the experts as plain functions of their weights ---------------------------------------------------
def ffn(x: torch.Tensor, w1, b1, w2, b2) -> torch.Tensor:
    """One expert, exactly as ``Experts.expert``: d_model -> d_ff -> GELU -> d_model."""
    return F.gelu(x @ w1 + b1) @ w2 + b2


def run_experts(rows: torch.Tensor, counts, weights, experts) -> torch.Tensor:
    """Rows grouped by expert (``counts[i]`` rows for expert ``experts[i]``, in order) through those
    experts, with ``weights = (w1, b1, w2, b2)`` indexed by ``experts``' ids; outputs in the same order."""
    chunks = rows.split([int(c) for c in counts])
    w1, b1, w2, b2 = weights
    outs = [ffn(chunk, w1[e], b1[e], w2[e], b2[e]) for chunk, e in zip(chunks, experts)]
    return torch.cat(outs) if outs else rows.new_zeros((0,) + tuple(rows.shape[1:]))


# --- the weights travel: all-gather forward, reduce-scatter backward --------------------------------------
class _GatherExperts(torch.autograd.Function):
    """Forward: every rank's flat expert weights, rank after rank. Backward: the gradient summed over
    the ranks, each rank keeping the slice of its own experts (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, flat, group, world):
        ctx.group, ctx.numel = group, flat.numel()
        out = flat.new_empty(world * flat.numel())
        comm.all_gather(out, flat.contiguous(), group=group)
        _label("dp experts")
        return out

    @staticmethod
    def backward(ctx, grad):
        mine = grad.new_empty(ctx.numel)
        comm.reduce_scatter(mine, grad.contiguous(), op="sum", group=ctx.group)
        _label("dp experts backward")
        return mine, None, None


def all_experts(layer):
    """(w1, b1, w2, b2), each with all E experts first, on every rank; differentiable into the owners'
    parameters (their gradients are the sum over ranks, as in expert parallelism)."""
    ex = layer.experts
    params = (ex.w1, ex.b1, ex.w2, ex.b2)
    if not dist.is_initialized() or layer.world == 1:
        return params
    flat = torch.cat([p.reshape(-1) for p in params])
    everyone = _GatherExperts.apply(flat, layer.group, layer.world).reshape(layer.world, -1)
    out, at = [], 0
    for p in params:
        n = p.numel()
        out.append(everyone[:, at:at + n].reshape((layer.num_experts,) + tuple(p.shape[1:])))
        at += n
    return tuple(out)


# --- the communication model ---------------------------------------------------------------------------
def expert_parameters(d_model: int, d_ff: int, num_experts: int) -> int:
    """P: parameters of all experts (two weight matrices and two biases each)."""
    return num_experts * (2 * d_model * d_ff + d_ff + d_model)


def parallel_costs(*, world: int, expert_params: int, rows_off_rank: int, d_model: int,
                   element_bytes: int = 4, training: bool = True) -> dict:
    """Bytes one rank sends per step for the expert layer under each placement.

    dp: all-gather of the experts, (W-1)/W * P elements, and in training the reduce-scatter of their
        gradients, the same again: 2 (W-1)/W * P (one all-reduce's worth: O(P)).
    ep: dispatch and combine each move the busiest rank's off-rank rows, ``rows_off_rank`` rows of
        d_model elements; training doubles it (their backwards): 4 * rows * d_model (O(C_g)).
    """
    passes = 2 if training else 1
    dp = passes * (world - 1) / world * expert_params * element_bytes if world > 1 else 0.0
    ep = passes * 2 * rows_off_rank * d_model * element_bytes
    return {"dp_bytes": float(dp), "ep_bytes": float(ep)}


def _size(nbytes: float) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def choose_parallel(costs: dict, *, num_experts: int, rows_off_rank: int, expert_params: int) -> tuple[str, str]:
    """("dp" | "ep", reason): the placement that sends fewer bytes, with a sentence that says why.
    Ties go to "ep" (no copies of the weights to hold)."""
    dp, ep = costs["dp_bytes"], costs["ep_bytes"]
    weights = f"{num_experts} experts' {expert_params:,} parameters ({_size(dp)} for all-gather + reduce-scatter)"
    tokens = f"{rows_off_rank:,} off-rank rows at the busiest rank ({_size(ep)} for the 4 all-to-alls)"
    if dp < ep:
        return "dp", (f"dp: moving the weights is cheaper: {weights} < {tokens}. Tutel: DP costs O(P) whatever "
                      f"the load; EP O(C_g) grows with the tokens routed.")
    return "ep", (f"ep: moving the tokens is cheaper: {tokens} <= {weights}. Tutel: EP costs O(C_g) (no P/E term: "
                  f"each expert has one owner); DP O(P) whatever the load.")


# --- the switch -----------------------------------------------------------------------------------------
class Placement:
    """Where the expert weights are used this forward: on their owners ("ep") or everywhere ("dp").

    ``mode`` is what was asked ("ep", "dp", "auto"); after each forward ``choice`` is what ran and
    ``reason`` why (for "auto": the communication model's comparison; ``costs`` holds its numbers).
    """

    def __init__(self, mode: str = "ep"):
        if mode not in MODES:
            raise ValueError(f"expert_parallel={mode!r}: choose 'ep' (experts stay on their owners, tokens "
                             f"travel), 'dp' (every rank uses every expert, weights travel) or 'auto' (the "
                             f"cheaper one per forward, by Tutel's communication model).")
        self.mode = mode
        self.choice = None if mode == "auto" else mode
        self.reason = {"ep": "ep: asked for (expert_parallel='ep')",
                       "dp": "dp: asked for (expert_parallel='dp')", "auto": None}[mode]
        self.costs = None

    def __repr__(self) -> str:
        return f"Placement(mode={self.mode!r}, choice={self.choice!r})"

    def replicate(self, layer, routing) -> bool:
        """True when this forward runs data-parallel. "auto" decides here (one tiny all-reduce)."""
        if self.mode == "ep":
            return False
        kept = routing.kept_counts
        El, r = layer.num_local, layer.rank
        rows_off = int(kept.sum() - kept[r * El:(r + 1) * El].sum())
        if self.mode == "auto" and dist.is_initialized() and layer.world > 1:
            busiest = torch.tensor([rows_off], dtype=torch.long)
            comm.all_reduce(busiest, op="max", group=layer.group)
            _label("parallel choice")
            rows_off = int(busiest.item())
        P = expert_parameters(layer.d_model, layer.d_ff, layer.num_experts)
        self.costs = parallel_costs(world=layer.world, expert_params=P, rows_off_rank=rows_off,
                                    d_model=layer.d_model, element_bytes=layer.experts.w1.element_size(),
                                    training=torch.is_grad_enabled())
        if self.mode == "auto":
            self.choice, self.reason = choose_parallel(self.costs, num_experts=layer.num_experts,
                                                       rows_off_rank=rows_off, expert_params=P)
        if recorder.enabled:
            recorder.metric(f"moe/{layer.name}/parallel",
                            {"mode": self.mode, "choice": self.choice, "reason": self.reason,
                             "rows_off_rank": rows_off, "expert_params": P, **self.costs},
                            step=enclosing_step())
        return self.choice == "dp"

    def forward(self, layer, tokens, routing):
        """Steps 2-6 data-parallel: all experts here, this rank's rows through them. -> (plan, order, answers)"""
        weights = all_experts(layer)
        order, rows = layer.sort_by_destination(tokens, routing)   # grouped by expert, ascending
        kept = routing.kept_counts
        with span(f"moe/{layer.name}/experts", rows=rows.shape[0], placement="dp"):
            answers = run_experts(rows, kept.tolist(), weights, range(layer.num_experts))
        # for the load record: this rank computed its own rows for its own experts (and the rest)
        W, El, r = layer.world, layer.num_local, layer.rank
        mine = torch.zeros(W, El, dtype=kept.dtype, device=kept.device)
        mine[r] = kept[r * El:(r + 1) * El]
        return Plan(mine, mine.clone()), order, answers
