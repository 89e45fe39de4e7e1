"""Tutel's switch, priced: what each way of running the expert layer costs on the link, and the choice.

``expert_parallel="auto"`` (``moe/placement.py``) asks this file, every forward, from everyone's counts:

    dp            all-gather of the experts' P parameters in forward, and in training the reduce-scatter
                  of their gradients: O(P), whatever the load (Tutel's (1))
    ep            the four all-to-alls of the rows routed (dispatch, combine, and both again in backward):
                  O(C_g), a rank timed by what it sends AND what it receives
    ep, W > E     with each expert sliced over s = W/E ranks and computed as r slices (Tutel's (7),
                  EP+DP+MP): the rows go to one rank of each of the r slice groups (so r times), and the
                  weights travel too: each slice group of s/r ranks all-gathers its storage slices into the
                  slice it computes (a reduce-scatter returns the gradient), and the s ranks of an expert
                  gather its output bias: O(C_g * r + P/E/r), the slice weights vanishing at r = s

Each collective is priced on the emulated link's own model (``comm/cost.py``, the function the emulator
holds every call to; a unit link, seconds read as bytes, when none is on), with every rank issuing it at
once (``together``: parallel groups share a node's card). With W > E and no ``expert_slices`` given,
auto also chooses r among the divisors of s, as Tutel's adaptive r does at run time (the released code
takes r per forward from the caller; the paper searches it): the cheapest of dp and every r.
"""

from __future__ import annotations

from ..comm.cost import demand, together
from ..comm.link import Link, Settings


def expert_parameters(d_model: int, d_ff: int, num_experts: int) -> int:
    """P: parameters of all experts (two weight matrices and two biases each)."""
    return num_experts * (2 * d_model * d_ff + d_ff + d_model)


UNIT_LINK = Settings(Link(bandwidth=1.0, latency=0.0))  # no emulated link: seconds read as bytes


def slice_weight_calls(slicing, d_model: int, element_bytes: int, ranks=None) -> list:
    """The weight collectives one EP+DP+MP forward issues at ``slicing``'s r: [(op, {global rank: its group},
    message bytes as the door sizes it)]: the slice group's all-gather of (w1, b1, w2) slices (when s/r > 1)
    and the expert's all-gather of b2 (every r). Backward repeats each as a reduce-scatter of the same size."""
    W, s, size = slicing.world, slicing.s, slicing.size
    ranks = list(range(W)) if ranks is None else list(ranks)
    f, bias = slicing.d_ff // s, -(-d_model // s)
    calls = []
    if size > 1:
        calls.append(
            (
                "all_gather",
                {ranks[q]: [ranks[p] for p in slicing.members(q)[0]] for q in range(W)},
                size * (2 * d_model * f + f) * element_bytes,
            )
        )
    calls.append(
        (
            "all_gather",
            {ranks[q]: [ranks[p] for p in slicing.members(q)[1]] for q in range(W)},
            s * bias * element_bytes,
        )
    )
    return calls


def parallel_costs(
    traffic,
    *,
    expert_params: int,
    d_model: int,
    element_bytes: int = 4,
    training: bool = True,
    settings=None,
    ranks=None,
    weights=(),
) -> dict:
    """Predicted seconds per step of the expert layer's communication under each placement.

    traffic[i][j]: rows rank i sends to rank j in the dispatch (``sharded.row_destinations``); the
        combine sends them back. weights: the weight collectives "ep" issues too (``slice_weight_calls``).
    Returns dp_s, ep_s (with ep_weights_s, its weights' part), and to read them by: dp_bytes (each rank,
    per step), ep_bytes (the busiest rank's rows, per step), ep_weight_bytes (the largest weight message
    per rank, times the passes), busiest (that rank's position), busiest_rows (the rows it sends or
    receives, the larger).
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

    def ring(op: str, groups: dict, nbytes: float) -> float:
        return together(link, {me: demand(link, op, group, me, nbytes) for me, group in groups.items()})

    everyone = {me: ranks for me in ranks}
    weight_s = sum(
        ring("all_gather", groups, nbytes) + (ring("reduce_scatter", groups, nbytes) if training else 0.0)
        for _, groups, nbytes in weights
    )
    weight_bytes = sum(
        passes * (len(next(iter(groups.values()))) - 1) / len(next(iter(groups.values()))) * nbytes
        for _, groups, nbytes in weights
    )
    moved = [max(sum(traffic[i]) - traffic[i][i], sum(t[i] for t in traffic) - traffic[i][i]) for i in range(W)]
    busiest = max(range(W), key=moved.__getitem__)
    return {
        "dp_s": ring("all_gather", everyone, size) + (ring("reduce_scatter", everyone, size) if training else 0.0),
        "ep_s": passes * (exchange(False) + exchange(True)) + weight_s,
        "ep_weights_s": weight_s,
        "dp_bytes": float(passes * (W - 1) / W * size if W > 1 else 0.0),
        "ep_bytes": float(passes * 2 * moved[busiest] * row),
        "ep_weight_bytes": float(weight_bytes),
        "busiest": busiest,
        "busiest_rows": int(moved[busiest]),
        "unit_link": settings is None,
    }


def _size(nbytes: float) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def choose_parallel(costs: dict, *, num_experts: int, expert_params: int) -> tuple[str, str]:
    """("dp" | "ep", reason): the placement the model says communicates faster, with a sentence that
    says why. Ties go to "ep" (no copies of the weights to hold). ``costs["r"]``, when there: the r that
    "ep" was priced at (EP+DP+MP)."""
    dp, ep = costs["dp_s"], costs["ep_s"]
    cost = (lambda s: _size(s)) if costs.get("unit_link") else (lambda s: f"{s * 1e3:.3g} ms")
    weights = (
        f"{num_experts} experts' {expert_params:,} parameters ({cost(dp)} for all-gather + reduce-scatter, "
        f"{_size(costs['dp_bytes'])} per rank)"
    )
    tokens = (
        f"the 4 all-to-alls ({cost(ep - costs.get('ep_weights_s', 0.0))}), whose slowest rank, rank "
        f"{costs['busiest']}, sends or receives {costs['busiest_rows']:,} rows ({_size(costs['ep_bytes'])})"
    )
    if costs.get("r") is not None:
        tokens = (
            f"EP+DP+MP at r={costs['r']}: {tokens}, plus its slice weights' gathers and reduce-scatters "
            f"({cost(costs.get('ep_weights_s', 0.0))}, {_size(costs.get('ep_weight_bytes', 0.0))} per rank)"
        )
    if dp < ep:
        return "dp", (
            f"dp: moving the weights is cheaper: {weights} < {tokens}. Tutel: DP costs O(P) whatever "
            f"the load; EP O(C_g) grows with the tokens routed, and the popular expert's rank receives most."
        )
    return "ep", (
        f"ep: moving the tokens is cheaper: {tokens} <= {weights}. Tutel: EP costs O(C_g); DP O(P) whatever the load."
    )
