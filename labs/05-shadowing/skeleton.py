"""Lab 05: which experts to shadow, FasterMoE's selection rule, written by you.

Four pure functions are yours: `worker_loads`, `latency_imbalanced`, `latency_shadowed` and
`choose_shadows` (Algorithm 1 of the paper, the greedy on the latency model). They take numbers and
return numbers: no process group, no tensors. The grader feeds your `choose_shadows` the counts of a
real 2-rank MoE layer and lets `toolkit.moe.MoE(shadow=your_choice)` shadow what you chose, so your
rule decides what travels on real ranks. Read README.md first, then grade your work with

    python -m toolkit grade labs/05-shadowing                     # grades this file
    python -m toolkit grade labs/05-shadowing --solution my.py    # or a copy of it

Notation (the paper's): W workers, E experts; counts[w][e] = rows worker w routes to expert e;
owners[e] = the worker that holds expert e; H = d_model; alpha = d_ff / d_model; P = FLOP/s of a
worker; W_net = link bytes/s; s = element_bytes.
"""

from __future__ import annotations


# --- yours: 1. who computes how many rows -------------------------------------------------------------
def worker_loads(counts, owners, shadowed=()) -> list:
    """B'_w for every worker w: rows it computes when the experts in `shadowed` run where their rows are.

    An unshadowed expert's rows, from every worker, are computed by its owner; a shadowed expert's rows
    stay with the worker that routed them. With nothing shadowed this is B_w.
    """
    raise NotImplementedError("worker_loads: not written yet")


# --- yours: 2. the latency model ----------------------------------------------------------------------
def latency_imbalanced(counts, owners, *, H, alpha, P, W_net, element_bytes=4) -> float:
    """Lat_imbl = max_w { 3 * 4 * B_w * alpha * H^2 / P  +  4 * B_w * H * s / W_net }: the plain layer.

    3 * 4 * alpha * H^2 FLOPs per row: two GEMMs of 2 * H * alpha*H FLOPs each, and backward costs
    twice forward; 4 * H * s bytes per row on the wire: dispatch and combine, forward and backward.
    """
    raise NotImplementedError("latency_imbalanced: not written yet")


def latency_shadowed(counts, owners, shadowed, *, H, alpha, P, W_net, element_bytes=4) -> float:
    """Lat_shadow = max_w 3 * 4 * B'_w * alpha * H^2 / P  +  2r * 2 * alpha * H^2 * s / W_net,
    r = the number of distinct experts in `shadowed`.

    2 * alpha * H^2 elements per expert (its two weight matrices), moved twice: parameters out to
    every worker, gradients back to the owner. As in the paper, the rows that still travel are not
    counted here.
    """
    raise NotImplementedError("latency_shadowed: not written yet")


# --- yours: 3. Algorithm 1 --------------------------------------------------------------------------------
def choose_shadows(counts, owners, *, H, alpha, P, W_net, element_bytes=4) -> list:
    """The experts to shadow, in the order they were accepted.

    Algorithm 1 as the README specifies it (heaviest first, ties by lower id; accept while the prediction
    falls below the best so far; the first that does not ends the search). Every rank runs this on the
    same counts and must reach the same choice.
    """
    raise NotImplementedError("choose_shadows: not written yet")
