"""Expert shadowing (FasterMoE): copy a popular expert to every rank instead of sending it the tokens.

Under skewed routing one expert gets most tokens; its owner computes them all while the other ranks
wait (the straggler). Shadowing expert e means: broadcast e's weights from its owner to every rank,
let every rank compute its own tokens for e locally (they no longer travel in the all-to-all), and in
backward bring e's gradient, summed over the ranks, back to the owner. The tokens stay home; the
weights travel, twice (parameters out, gradients back). Whether that pays depends on the load, the
expert's size, the compute rate and the link, which is what the paper's performance model weighs.

The model (FasterMoE, PPoPP'22; H = d_model, alpha*H = d_ff, P = FLOP/s, W_net = link bytes/s,
B_w = rows worker w computes, s = bytes per element):

    Lat_imbl     = max_w { 3 * 4 * B_w * alpha*H^2 / P  +  4 * B_w * H * s / W_net }
    Lat_shadow(r) = max_w 3 * 4 * B'_w * alpha*H^2 / P  +  2r * 2 * alpha*H^2 * s / W_net

3 * 4 * alpha*H^2 FLOPs per row: two GEMMs of 2 * H * alpha*H FLOPs, times 3 for forward plus
backward; 4 * H elements per row on the wire: dispatch and combine, in forward and in backward;
2 * alpha*H^2 elements per expert (its two weight matrices), moved twice (broadcast, gradient return).
The paper counts elements; we multiply by s so that W_net is in bytes/s. B'_w is what worker w
computes once the r shadowed experts' rows stay with their senders: the rows of its own unshadowed
experts from everyone, plus its own rows for every shadowed expert. As in the paper, Lat_shadow
counts the remaining computation and the weights' traffic only.

Algorithm 1 (greedy, ``choose_shadows``): sort the experts by load (rows routed to them, from all
ranks), heaviest first; start from Lat_imbl; tentatively shadow the next expert, recompute every B'_w
and Lat_shadow; keep it while the predicted latency falls, stop at the first that does not lower it.
(FastMoE's released shadow_policy.py differs: it sorts the per-sender totals and counts one transfer;
this follows the paper.)

This file is the performance model and Algorithm 1, pure functions that a lab and the tests call
directly; ``moe/shadow_layer.py`` applies them in the layer (``shadow="auto"`` or ``shadow=[...]``),
and ``moe/shadow_steps.py`` runs the steps with the rows kept home.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .machine import _positive


def _check(counts, owners):
    rows = [[float(c) for c in row] for row in (counts.tolist() if hasattr(counts, "tolist") else counts)]
    if not rows or not rows[0] or any(len(r) != len(rows[0]) for r in rows):
        raise ValueError(
            "counts must be a (workers, experts) table: counts[w][e] = rows worker w routes to "
            "expert e, one row per worker, one column per expert."
        )
    if any(c < 0 for r in rows for c in r):
        raise ValueError("counts must be >= 0 (rows routed).")
    W, E = len(rows), len(rows[0])
    owners = [int(o) for o in owners]
    if len(owners) != E or any(not 0 <= o < W for o in owners):
        raise ValueError(
            f"owners must give, for each of the {E} experts, the worker (0..{W - 1}) that holds it; got {owners}."
        )
    return rows, owners


def worker_loads(counts, owners, shadowed=()) -> list:
    """B'_w: rows each worker computes when ``shadowed`` experts run at home (B_w when none is).

    counts[w][e]: rows worker w routes to expert e; owners[e]: the worker that holds expert e.
    """
    rows, owners = _check(counts, owners)
    shadowed = set(shadowed)
    B = [0.0] * len(rows)
    for w, row in enumerate(rows):
        for e, c in enumerate(row):
            B[w if e in shadowed else owners[e]] += c
    return B


def _unit_costs(H, alpha, P, W_net, element_bytes):
    H, alpha = _positive("H", H), _positive("alpha", alpha)
    P = _positive("P (compute FLOP/s)", P)
    W_net = W_net if W_net == math.inf else _positive("W_net (bytes/s)", W_net)  # inf: nothing travels (one rank)
    compute = 3 * 4 * alpha * H * H / P  # seconds per row, forward + backward
    wire = 4 * H * element_bytes / W_net  # seconds per row, 4 all-to-all passes
    weights = 2 * alpha * H * H * element_bytes / W_net  # seconds per expert per transfer
    return compute, wire, weights


def latency_imbalanced(counts, owners, *, H, alpha, P, W_net, element_bytes=4) -> float:
    """Lat_imbl = max_w {3*4*B_w*alpha*H^2/P + 4*B_w*H*s/W_net}: the plain layer, waiting for its busiest worker."""
    compute, wire, _ = _unit_costs(H, alpha, P, W_net, element_bytes)
    return max(b * (compute + wire) for b in worker_loads(counts, owners))


def latency_shadowed(counts, owners, shadowed, *, H, alpha, P, W_net, element_bytes=4) -> float:
    """Lat_shadow(r) = max_w 3*4*B'_w*alpha*H^2/P + 2r*2*alpha*H^2*s/W_net for the r experts in ``shadowed``."""
    compute, _, weights = _unit_costs(H, alpha, P, W_net, element_bytes)
    return max(worker_loads(counts, owners, shadowed)) * compute + 2 * len(set(shadowed)) * weights


@dataclass
class ShadowChoice:
    """What the predictor decided, and the numbers behind it (seconds)."""

    shadowed: list  # experts to shadow, in the order they were accepted
    predicted_s: float  # predicted latency with them (Lat_imbl when none)
    plain_s: float  # Lat_imbl: predicted latency without shadowing
    loads: list  # B_w without shadowing
    loads_shadowed: list  # B'_w with the chosen set
    trail: list = field(default_factory=list)  # Algorithm 1's steps: expert, load, latency_s, accepted

    def as_dict(self) -> dict:
        return {
            "shadowed": list(self.shadowed),
            "predicted_s": self.predicted_s,
            "plain_s": self.plain_s,
            "loads": list(self.loads),
            "loads_shadowed": list(self.loads_shadowed),
            "trail": list(self.trail),
        }

    def explain(self) -> str:
        """Algorithm 1's reasoning, one line per step, for a notebook or a lab's feedback."""
        lines = [f"no shadow: Lat_imbl = {self.plain_s:.4g} s (rows per worker {self._fmt(self.loads)})"]
        for step in self.trail:
            verdict = "accept" if step["accepted"] else "stop: it does not lower the latency"
            lines.append(
                f"+ shadow expert {step['expert']} (load {step['load']:g}): "
                f"Lat_shadow = {step['latency_s']:.4g} s -> {verdict}"
            )
        lines.append(
            f"shadowed {self.shadowed or 'nothing'}: predicted {self.predicted_s:.4g} s "
            f"(rows per worker {self._fmt(self.loads_shadowed)})"
        )
        return "\n".join(lines)

    @staticmethod
    def _fmt(loads) -> str:
        return "[" + ", ".join(f"{b:g}" for b in loads) + "]"


def choose_shadows(counts, owners, *, H, alpha, P, W_net, element_bytes=4) -> ShadowChoice:
    """FasterMoE's Algorithm 1: which experts to shadow for this forward.

    counts[w][e]  rows worker w routes to expert e (every rank's, so every rank decides alike)
    owners[e]     the worker holding expert e
    H, alpha      d_model and d_ff / d_model;  P  FLOP/s;  W_net  bytes/s;  element_bytes  s

    Experts are tried heaviest first (ties: lower id first); each is kept while Lat_shadow falls below
    the best latency so far (starting from Lat_imbl); the first that does not lower it ends the search.
    """
    rows, owners = _check(counts, owners)
    model = dict(H=H, alpha=alpha, P=P, W_net=W_net, element_bytes=element_bytes)
    load = [sum(r[e] for r in rows) for e in range(len(owners))]
    best = plain = latency_imbalanced(rows, owners, **model)
    chosen, trail = [], []
    for e in sorted(range(len(load)), key=lambda e: (-load[e], e)):
        latency = latency_shadowed(rows, owners, chosen + [e], **model)
        accepted = latency < best
        trail.append({"expert": e, "load": load[e], "latency_s": latency, "accepted": accepted})
        if not accepted:
            break
        chosen.append(e)
        best = latency
    return ShadowChoice(chosen, best, plain, worker_loads(rows, owners), worker_loads(rows, owners, chosen), trail)


def predict(counts, owners, shadowed, *, H, alpha, P, W_net, element_bytes=4) -> ShadowChoice:
    """The model's numbers for a given set (``shadow=[...]``): Lat_shadow, or Lat_imbl when empty."""
    rows, owners = _check(counts, owners)
    model = dict(H=H, alpha=alpha, P=P, W_net=W_net, element_bytes=element_bytes)
    shadowed = sorted(set(shadowed))
    plain = latency_imbalanced(rows, owners, **model)
    predicted = latency_shadowed(rows, owners, shadowed, **model) if shadowed else plain
    return ShadowChoice(shadowed, predicted, plain, worker_loads(rows, owners), worker_loads(rows, owners, shadowed))
