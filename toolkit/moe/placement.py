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
r) and "ep" runs that layout.

The switch costs nothing (Tutel's point): storage is the expert-parallel layout in both cases (rank r
keeps its experts, or its slice of one, and their optimizer state), so "dp" is a way of running a step,
not another model: all-gather + reduce-scatter is exactly an all-reduce of the gradients that skips
the all-gather no rank needs. That lets ``expert_parallel="auto"`` choose per layer and per forward
from the communication model: the time each would take for the rows actually routed, predicted with
the emulated link's own model (``comm/cost.py``; a unit link, seconds as bytes, when none is on), where
an all-to-all lasts as long as its slowest rank and a rank is timed by what it sends and what it
receives. One all-gather of the per-expert counts lets every rank predict the same and decide alike.
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
from ..comm.cost import demand, together
from ..comm.emulate import Link, Settings
from ..trace.events import recorder, span
from .experts import WEIGHTS, GatherWeights, join_slices
from .load import enclosing_step
from .machine import _label
from .plan import Plan
from .sharded import row_destinations

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
        stacked = everyone[:, at:at + n].reshape((layer.world * ex.num_local,) + tuple(p.shape[1:]))
        out.append(join_slices(stacked, name, ex.shard[1], layer.d_model))
        at += n
    return tuple(out)


# --- the communication model ---------------------------------------------------------------------------
def expert_parameters(d_model: int, d_ff: int, num_experts: int) -> int:
    """P: parameters of all experts (two weight matrices and two biases each)."""
    return num_experts * (2 * d_model * d_ff + d_ff + d_model)


UNIT_LINK = Settings(Link(bandwidth=1.0, latency=0.0))  # no emulated link: seconds read as bytes


def parallel_costs(traffic, *, expert_params: int, d_model: int, element_bytes: int = 4, training: bool = True,
                   settings=None, ranks=None) -> dict:
    """Predicted seconds per step of the expert layer's communication under each placement, on the
    emulated link's own model (``comm/cost.py``: the function the emulator holds every call to), so the
    choice and the time it is measured in agree. Without an emulated link, a unit link (1 byte/s, no
    latency): the seconds read as bytes.

    traffic[i][j]: rows rank i sends to rank j in the dispatch (``sharded.row_destinations``); the
        combine sends them back.
    dp: all-gather of the experts' P parameters in forward; in training, the reduce-scatter of their
        gradients: O(P), whatever the load.
    ep: dispatch and combine, and both again in training (their backwards). Each all-to-all lasts as
        long as its slowest rank, and a rank is timed by what it sends AND what it receives: under skew
        the popular expert's owner, receiving from everyone, is the slowest: O(C_g).
    Returns dp_s, ep_s, and to read them by: dp_bytes (each rank, per step), ep_bytes (the busiest rank,
    per step), busiest (that rank's position), busiest_rows (the rows it sends or receives, the larger).
    """
    W = len(traffic)
    ranks = list(range(W)) if ranks is None else list(ranks)
    link = settings or UNIT_LINK
    row, size, passes = d_model * element_bytes, expert_params * element_bytes, 2 if training else 1

    def exchange(back: bool) -> float:
        demands = {}
        for i, me in enumerate(ranks):
            sent, received = [t * row for t in traffic[i]], [traffic[j][i] * row for j in range(W)]
            if back:
                sent, received = received, sent
            demands[me] = demand(link, "all_to_all", ranks, me, 0.0, dict(sent=sent, received=received))
        return together(link, demands)

    def ring(op: str) -> float:
        return together(link, {me: demand(link, op, ranks, me, size) for me in ranks})

    moved = [max(sum(traffic[i]) - traffic[i][i], sum(t[i] for t in traffic) - traffic[i][i]) for i in range(W)]
    busiest = max(range(W), key=moved.__getitem__)
    return {"dp_s": ring("all_gather") + (ring("reduce_scatter") if training else 0.0),
            "ep_s": passes * (exchange(False) + exchange(True)),
            "dp_bytes": float(passes * (W - 1) / W * size if W > 1 else 0.0),
            "ep_bytes": float(passes * 2 * moved[busiest] * row), "busiest": busiest,
            "busiest_rows": int(moved[busiest]), "unit_link": settings is None}


def _size(nbytes: float) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def choose_parallel(costs: dict, *, num_experts: int, expert_params: int) -> tuple[str, str]:
    """("dp" | "ep", reason): the placement the model says communicates faster, with a sentence that
    says why. Ties go to "ep" (no copies of the weights to hold)."""
    dp, ep = costs["dp_s"], costs["ep_s"]
    cost = (lambda s: _size(s)) if costs.get("unit_link") else (lambda s: f"{s * 1e3:.3g} ms")
    weights = (f"{num_experts} experts' {expert_params:,} parameters ({cost(dp)} for all-gather + reduce-scatter, "
               f"{_size(costs['dp_bytes'])} per rank)")
    tokens = (f"the 4 all-to-alls ({cost(ep)}), whose slowest rank, rank {costs['busiest']}, sends or receives "
              f"{costs['busiest_rows']:,} rows ({_size(costs['ep_bytes'])})")
    if dp < ep:
        return "dp", (f"dp: moving the weights is cheaper: {weights} < {tokens}. Tutel: DP costs O(P) whatever "
                      f"the load; EP O(C_g) grows with the tokens routed, and the popular expert's rank receives most.")
    return "ep", (f"ep: moving the tokens is cheaper: {tokens} <= {weights}. Tutel: EP costs O(C_g); DP O(P) "
                  f"whatever the load.")


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
        """True when this forward runs data-parallel. "auto" decides here, from everyone's counts (one
        small all-gather), so every rank predicts the same times and makes the same choice."""
        if self.mode == "ep":
            return False
        if self.mode == "dp":
            if recorder.enabled:
                recorder.metric(f"moe/{layer.name}/parallel", {"mode": "dp", "choice": "dp", "reason": self.reason},
                                step=enclosing_step())
            return True
        kept = routing.kept_counts
        counts = kept.reshape(1, -1)
        if dist.is_initialized() and layer.world > 1:
            everyone = kept.new_empty(layer.world * kept.numel())
            comm.all_gather(everyone, kept.contiguous(), group=layer.group)
            _label("parallel choice")
            counts = everyone.reshape(layer.world, -1)
        slices = layer.slicing.r if layer.slicing else None
        traffic = [row_destinations(c, layer.world, layer.num_experts, slices) for c in counts.tolist()]
        P = expert_parameters(layer.d_model, layer.d_ff, layer.num_experts)
        ranks = comm.group_ranks(layer.group) if dist.is_initialized() else None
        self.costs = parallel_costs(traffic, expert_params=P, d_model=layer.d_model,
                                    element_bytes=layer.experts.w1.element_size(), training=torch.is_grad_enabled(),
                                    settings=comm.emulated_link(), ranks=ranks)
        self.choice, self.reason = choose_parallel(self.costs, num_experts=layer.num_experts, expert_params=P)
        if recorder.enabled:
            recorder.metric(f"moe/{layer.name}/parallel",
                            {"mode": self.mode, "choice": self.choice, "reason": self.reason, "expert_params": P,
                             **self.costs}, step=enclosing_step())
        return self.choice == "dp"

    def forward(self, layer, tokens, routing):
        """Steps 2-6 data-parallel: all experts here, this rank's rows through them. -> (plan, order, answers)"""
        weights = all_experts(layer)
        order, rows = layer.sort_by_destination(tokens, routing)   # grouped by expert, ascending
        kept = routing.kept_counts
        with span(f"moe/{layer.name}/experts", rows=rows.shape[0], placement="dp"):
            answers = run_experts(rows, kept.tolist(), weights, range(layer.num_experts))
        # for the load record: this rank computed its own rows for its own experts (and the rest)
        W, El, r, first = layer.world, layer.num_local, layer.rank, layer.experts.first
        mine = torch.zeros(W, El, dtype=kept.dtype, device=kept.device)
        mine[r] = kept[first:first + El]
        return Plan(mine, mine.clone()), order, answers
