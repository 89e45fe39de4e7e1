"""Lab 05: which experts to shadow, FasterMoE's selection rule (the reference solution).

Four pure functions are yours: `worker_loads`, `latency_imbalanced`, `latency_shadowed` and
`choose_shadows` (Algorithm 1 of the paper, the greedy on the latency model). They take numbers and
return numbers: no process group, no tensors. The grader feeds your `choose_shadows` the counts of a
real 2-rank MoE layer and lets `toolkit.moe.MoE(shadow=your_choice)` shadow what you chose, so your
rule decides what travels on real ranks. Read README.md first, then grade your work with

    python -m toolkit grade labs/05-shadowing                     # grades skeleton.py
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
    shadowed = set(shadowed)
    loads = [0.0] * len(counts)
    for w, row in enumerate(counts):
        for e, rows in enumerate(row):
            loads[w if e in shadowed else owners[e]] += rows
    return loads


# --- yours: 2. the latency model ----------------------------------------------------------------------
def latency_imbalanced(counts, owners, *, H, alpha, P, W_net, element_bytes=4) -> float:
    """Lat_imbl = max_w { 3 * 4 * B_w * alpha * H^2 / P  +  4 * B_w * H * s / W_net }: the plain layer."""
    compute = 3 * 4 * alpha * H * H / P  # seconds per row: two GEMMs, forward and backward
    wire = 4 * H * element_bytes / W_net  # seconds per row: dispatch and combine, twice
    return max(b * (compute + wire) for b in worker_loads(counts, owners))


def latency_shadowed(counts, owners, shadowed, *, H, alpha, P, W_net, element_bytes=4) -> float:
    """Lat_shadow = max_w 3 * 4 * B'_w * alpha * H^2 / P  +  2r * 2 * alpha * H^2 * s / W_net,
    r = the number of distinct experts in `shadowed` (weights out, gradients back: two transfers each)."""
    compute = 3 * 4 * alpha * H * H / P
    weights = 2 * alpha * H * H * element_bytes / W_net
    r = len(set(shadowed))
    return max(worker_loads(counts, owners, shadowed)) * compute + 2 * r * weights


# --- yours: 3. Algorithm 1 --------------------------------------------------------------------------------
def choose_shadows(counts, owners, *, H, alpha, P, W_net, element_bytes=4) -> list:
    """The experts to shadow, in the order they were accepted.

    Experts are tried heaviest first (load = rows routed to it by all workers; ties: lower id first).
    Start from Lat_imbl; tentatively add the next expert; keep it if Lat_shadow of the set so far plus
    it is below the best latency so far (which it then becomes); at the first that is not, stop.
    """
    model = dict(H=H, alpha=alpha, P=P, W_net=W_net, element_bytes=element_bytes)
    load = [sum(row[e] for row in counts) for e in range(len(owners))]
    best = latency_imbalanced(counts, owners, **model)
    chosen = []
    for e in sorted(range(len(load)), key=lambda e: (-load[e], e)):
        latency = latency_shadowed(counts, owners, chosen + [e], **model)
        if latency >= best:
            break
        chosen.append(e)
        best = latency
    return chosen
