"""Switchable parallelism for the expert weights (Tutel): move the tokens, or move the weights.

Expert parallelism ("ep") leaves each expert on its owner and sends the tokens there and back: four
all-to-alls per training step (dispatch, combine, and both again in backward), whose size grows with
the tokens routed (Tutel's C_g). Data parallelism ("dp") does the opposite: every rank gets a copy of
every expert for the step and computes its own tokens with them; no token travels, the weights do:
an all-gather of the experts in forward and, in backward, a reduce-scatter that brings each expert's
gradient, summed over the ranks, back to its owner. That is O(P) bytes for P expert parameters,
whatever the load. Tutel's table: DP O(P), EP+DP O(C_g + P/E), EP+DP+MP O(C_g * W/E). With E >= W
every expert has exactly one owner, so the P/E term, the all-reduce among an expert's replicas, is
zero and EP costs O(C_g); with W > E each expert is sliced over W/E ranks (``moe/sharded.py``, Tutel's
r) and "ep" runs that layout, its slice weights travelling too when r < W/E.

The switch costs nothing (Tutel's point): storage is the expert-parallel layout in both cases (rank r
keeps its experts, or its slice of one, and their optimizer state), so "dp" is a way of running a step,
not another model: all-gather + reduce-scatter is exactly an all-reduce of the gradients that skips
the all-gather no rank needs. That lets ``expert_parallel="auto"`` choose per layer and per forward
from the communication model: the time each would take for the rows actually routed, predicted with
the emulated link's own model (``moe/placement_cost.py``), where an all-to-all lasts as long as its
slowest rank and a rank is timed by what it sends and what it receives, and EP+DP+MP pays for its slice
weights; with W > E and no ``expert_slices`` given it also picks r (Tutel's adaptive r). One all-gather of
the per-expert counts lets every rank predict the same and decide alike. The choice and its reason are
kept in ``placement.choice`` / ``placement.reason`` and recorded as ``moe/{name}/parallel``. Outputs and
gradients are the same either way.

Note the kinship with shadowing (moe/shadow.py): "dp" is shadowing every expert, with the per-expert
broadcasts and gradient reductions batched into one all-gather and one reduce-scatter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import comm
from ..trace.events import recorder, span
from .experts import WEIGHTS, GatherWeights, join_slices
from .load import enclosing_step
from .machine import _label
from .placement_cost import UNIT_LINK, choose_parallel, expert_parameters, parallel_costs, slice_weight_calls  # noqa: F401
from .plan import Plan
from .sharded import row_destinations

MODES = ("ep", "dp", "auto")


# --- the experts as plain functions of their weights ---------------------------------------------------
def ffn(x: torch.Tensor, w1, b1, w2, b2) -> torch.Tensor:
    """One expert, exactly as ``Experts.expert``: d_model -> d_ff -> GELU -> d_model."""
    return F.gelu(x @ w1 + b1) @ w2 + b2


def run_experts(rows: torch.Tensor, counts, weights, experts, fn=ffn) -> torch.Tensor:
    """Rows grouped by expert (``counts[i]`` rows for expert ``experts[i]``, in order) through those
    experts, with ``weights = (w1, b1, w2, b2)`` indexed by ``experts``' ids; outputs in the same order.
    ``fn(x, *one expert's weights)`` is the expert (another layer's experts, e.g. ``moe/hf.py``'s, bring theirs)."""
    chunks = rows.split([int(c) for c in counts])
    outs = [fn(chunk, *(w[e] for w in weights)) for chunk, e in zip(chunks, experts)]
    return torch.cat(outs) if outs else rows.new_zeros((0,) + tuple(rows.shape[1:]))


# --- the weights travel: all-gather forward, reduce-scatter backward --------------------------------------
def all_experts(layer):
    """(w1, b1, w2, b2), each with all E experts first, on every rank; differentiable into the owners'
    parameters (their gradients are the sum over ranks, as in expert parallelism). With W > E each
    rank holds a slice of one expert (moe/sharded.py): the slices are joined into whole experts."""
    ex = layer.experts
    params = (ex.w1, ex.b1, ex.w2, ex.b2)
    if not dist.is_initialized() or layer.world == 1:
        return params
    flat = torch.cat([p.reshape(-1) for p in params])
    everyone = GatherWeights.apply(flat, layer.group, layer.world, "dp experts", params).reshape(layer.world, -1)
    out, at = [], 0
    for name, p in zip(WEIGHTS, params):
        n = p.numel()
        stacked = everyone[:, at : at + n].reshape((layer.world * ex.num_local,) + tuple(p.shape[1:]))
        out.append(join_slices(stacked, name, ex.shard[1], layer.d_model))
        at += n
    return tuple(out)


# --- the switch -----------------------------------------------------------------------------------------
class Placement:
    """Where the expert weights are used this forward: on their owners ("ep") or everywhere ("dp").

    ``mode`` is what was asked ("ep", "dp", "auto"); after each forward ``choice`` is what ran and
    ``reason`` why (for "auto": the communication model's comparison; ``costs`` holds its numbers).
    """

    def __init__(self, mode: str = "ep"):
        if mode not in MODES:
            raise ValueError(
                f"expert_parallel={mode!r}: choose 'ep' (experts stay on their owners, tokens "
                f"travel), 'dp' (every rank uses every expert, weights travel) or 'auto' (the "
                f"cheaper one per forward, by Tutel's communication model)."
            )
        self.mode = mode
        self.choice = None if mode == "auto" else mode
        self.reason = {
            "ep": "ep: asked for (expert_parallel='ep')",
            "dp": "dp: asked for (expert_parallel='dp')",
            "auto": None,
        }[mode]
        self.costs = None

    def __repr__(self) -> str:
        return f"Placement(mode={self.mode!r}, choice={self.choice!r})"

    def replicate(self, layer, routing) -> bool:
        """True when this forward runs data-parallel. "auto" decides here, from everyone's counts (one
        small all-gather), so every rank predicts the same times and makes the same choice."""
        if self.mode == "ep":
            return False
        if self.mode == "dp":
            if recorder.enabled:
                recorder.metric(
                    f"moe/{layer.name}/parallel",
                    {"mode": "dp", "choice": "dp", "reason": self.reason},
                    step=enclosing_step(),
                )
            return True
        kept = routing.kept_counts
        counts = kept.reshape(1, -1)
        if dist.is_initialized() and layer.world > 1:
            everyone = kept.new_empty(layer.world * kept.numel())
            comm.all_gather(everyone, kept.contiguous(), group=layer.group)
            _label("parallel choice")
            counts = everyone.reshape(layer.world, -1)
        ranks = comm.group_ranks(layer.group) if dist.is_initialized() else None
        slicing, self.costs = self.price(layer, counts.tolist(), comm.emulated_link(), ranks, torch.is_grad_enabled())
        P = self.costs["expert_params"]
        self.choice, self.reason = choose_parallel(self.costs, num_experts=layer.num_experts, expert_params=P)
        if self.choice == "ep" and slicing is not None:
            layer.slicing = slicing  # Tutel's adaptive r: this forward computes the experts as r slices
        if recorder.enabled:
            recorder.metric(
                f"moe/{layer.name}/parallel",
                {"mode": self.mode, "choice": self.choice, "reason": self.reason, **self.costs},
                step=enclosing_step(),
            )
        return self.choice == "dp"

    def price(self, layer, counts, settings=None, ranks=None, training=True) -> tuple:
        """(the Slicing "ep" would run, or None for whole experts; its costs against "dp"): the cheapest
        way of running "ep" for everyone's ``counts`` (one list of kept rows per expert, per rank)."""
        P = expert_parameters(layer.d_model, layer.d_ff, layer.num_experts)
        size = layer.experts.w1.element_size()
        best = None
        for slicing in self._slicings(layer):  # W > E: every r Tutel allows (one, if expert_slices fixed it)
            traffic = [row_destinations(c, layer.world, layer.num_experts, slicing and slicing.r) for c in counts]
            weights = slice_weight_calls(slicing, layer.d_model, size, ranks) if slicing else ()
            costs = parallel_costs(
                traffic,
                expert_params=P,
                d_model=layer.d_model,
                element_bytes=size,
                training=training,
                settings=settings,
                ranks=ranks,
                weights=weights,
            )
            costs.update(r=slicing and slicing.r, expert_params=P)
            if best is None or costs["ep_s"] < best[1]["ep_s"]:  # ties keep the larger r: fewer weights move
                best = slicing, costs
        return best

    @staticmethod
    def _slicings(layer) -> list:
        """What "ep" may mean: whole experts ([None]); with W > E, the layer's r when ``expert_slices`` fixed
        it, else every divisor of s, largest first (Tutel's EP+MP first: no weight moves)."""
        if layer.slicing is None:
            return [None]
        if layer.slicing.chosen:
            return [layer.slicing]
        s = layer.slicing.s
        return [layer.slicing.with_slices(r) for r in range(s, 0, -1) if s % r == 0]

    def forward(self, layer, tokens, routing):
        """Steps 2-6 data-parallel: all experts here, this rank's rows through them. -> (plan, order, answers)"""
        weights = all_experts(layer)
        order, rows = layer.sort_by_destination(tokens, routing)  # grouped by expert, ascending
        kept = routing.kept_counts
        with span(f"moe/{layer.name}/experts", rows=rows.shape[0], placement="dp"):
            answers = run_experts(rows, kept.tolist(), weights, range(layer.num_experts))
        # for the load record: this rank computed its own rows for its own experts (and the rest)
        W, El, r, first = layer.world, layer.num_local, layer.rank, layer.experts.first
        mine = torch.zeros(W, El, dtype=kept.dtype, device=kept.device)
        mine[r] = kept[first : first + El]
        return Plan(mine, mine.clone()), order, answers
