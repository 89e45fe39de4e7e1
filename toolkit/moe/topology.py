"""The topology-aware gate (FasterMoE): keep most rows inside their node.

A cluster's links are not equal: GPUs in one node talk over fast local links, nodes over a slower
network. If every worker sends as many rows out of its node as the router likes, the network is the
bottleneck. FasterMoE's gate caps the rows that leave a node at L per worker (highest scores first)
and lets the rest re-pick among the experts inside their node; the weights, slots and capacity that
follow are the ordinary top-k gate's (`moe/gates.py`).
"""

from __future__ import annotations

import math

import torch

from . import machine
from .gates import TopKGate, _is_int, _is_real
from .routing import Routing

__all__ = ["TopologyGate", "make_gate", "topology_limit"]


def topology_limit(rows: int, bandwidth: float, local_bandwidth: float, node_size: int) -> int:
    """FasterMoE's L: how many of its ``rows`` one worker may send out of its node.

    ``L = W_net / (M * W_local) * B`` for B rows, M workers per node, cross-node bandwidth W_net and
    intra-node bandwidth W_local. Why: each worker pushes its B rows over its own local link in
    B / W_local, but the rows that leave the node share the node's one cross-node link, so the M
    workers' L rows each take M * L / W_net. Asking the cross-node part to take no longer than the
    local part, M * L / W_net <= B / W_local, gives L. Rounded down (rows are whole); with
    W_net >= M * W_local nothing is constrained (L >= B).
    """
    if not _is_int(rows) or rows < 0:
        raise ValueError(f"topology_limit: rows must be an int >= 0 (rows this worker dispatches), got {rows!r}.")
    if not _is_int(node_size) or node_size < 1:
        raise ValueError(f"topology_limit: node_size must be an int >= 1 (workers per node), got {node_size!r}.")
    for name, value in (("bandwidth", bandwidth), ("local_bandwidth", local_bandwidth)):
        if not _is_real(value) or value <= 0:
            raise ValueError(f"topology_limit: {name} must be a finite number > 0 (bytes/s), got {value!r}.")
    return math.floor(float(bandwidth) / (node_size * float(local_bandwidth)) * rows + 1e-9)


class TopologyGate(TopKGate):
    """FasterMoE's topology-aware gate: the top-k, then at most L rows per worker leave its node.

    Ranks form nodes of ``node_size`` consecutive ranks (rank r is on node r // node_size). Experts
    sit where expert parallelism puts them (rank r holds experts r*E/W .. (r+1)*E/W - 1), so a node
    holds node_size * E / W consecutive experts. On rank ``rank``, after the ordinary top-k:

    1. count the choices whose expert is on another node (rows that would cross the slow link);
    2. at most L = floor(cross_fraction * T * k) of them may go (T * k = rows this worker
       dispatches; cross_fraction = W_net / (M * W_local), see ``topology_limit``): those with the
       highest gate probability, ties to the earlier token and the earlier choice;
    3. every other one re-picks: the best-scoring expert inside the node that the token has not
       chosen already.

    The weights are the softmax probabilities of the final choices (renormalised over the k for
    k > 1), so the router still learns from every choice; slots, capacity and losses follow exactly as
    in ``TopKGate``. The routing depends on the rank by design: it is a different model from the
    plain gate, not a faster way to compute the same one. ``last`` holds the last forward's counts:
    wanted (crossing choices of the plain top-k), limit (L), sent (crossing after the limit),
    redirected (wanted - sent), per_node (choices per destination node), node (this rank's node).
    """

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        top_k: int = 2,
        capacity_factor: float = 1.25,
        *,
        world: int,
        rank: int,
        node_size: int,
        cross_fraction: float,
        **options,
    ):
        super().__init__(d_model, num_experts, top_k, capacity_factor, **options)
        if not _is_int(world) or world < 1:
            raise ValueError(
                f"TopologyGate: world must be an int >= 1 (ranks of the expert-parallel group), got {world!r}."
            )
        if not _is_int(node_size) or node_size < 1:
            raise ValueError(f"TopologyGate: node_size must be an int >= 1 (ranks per node), got {node_size!r}.")
        if world % node_size:
            fits = [m for m in range(1, world + 1) if world % m == 0]
            raise ValueError(
                f"TopologyGate: node_size={node_size} does not divide the world size {world}: every "
                f"node must hold the same number of ranks. Choose one of {fits}."
            )
        if num_experts % world:
            raise ValueError(f"TopologyGate: num_experts={num_experts} does not split evenly over {world} ranks.")
        per_node = node_size * (num_experts // world)
        if per_node < top_k:
            raise ValueError(
                f"TopologyGate: a node of {node_size} rank(s) holds {per_node} expert(s), fewer than "
                f"top_k={top_k}: a token could not re-pick inside its node. Use bigger nodes or a "
                f"smaller top_k."
            )
        if not _is_real(cross_fraction) or cross_fraction < 0:
            raise ValueError(
                f"TopologyGate: cross_fraction must be a finite number >= 0 "
                f"(W_net / (node_size * W_local)), got {cross_fraction!r}."
            )
        self.world, self.node_size, self.cross_fraction = int(world), int(node_size), float(cross_fraction)
        self.rank = rank  # settable: a one-process reference gates each rank's chunk with that rank
        self.experts_per_node = per_node
        self.last: dict | None = None

    @property
    def rank(self) -> int:
        return self._rank

    @rank.setter
    def rank(self, value: int) -> None:
        if not _is_int(value) or not 0 <= value < self.world:
            raise ValueError(f"TopologyGate: rank must be an int in [0, {self.world}), got {value!r}.")
        self._rank = int(value)

    @property
    def node(self) -> int:
        return self._rank // self.node_size

    def extra_repr(self) -> str:
        return (
            super().extra_repr() + f", world={self.world}, node_size={self.node_size}, "
            f"cross_fraction={self.cross_fraction:.4g}"
        )

    def limit(self, num_tokens: int) -> int:
        """L for ``num_tokens`` tokens: floor(cross_fraction * num_tokens * k)."""
        return math.floor(self.cross_fraction * num_tokens * self.top_k + 1e-9)

    def node_of_expert(self, device=None) -> torch.Tensor:
        """(E,) long: the node that holds each expert."""
        return torch.arange(self.num_experts, device=device) // self.experts_per_node

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        T, k = scores.shape[0], self.top_k
        index = scores.topk(k, dim=-1).indices
        node_of = self.node_of_expert(scores.device)
        inside = node_of == self.node  # (E,) experts on my node
        leaving = ~inside[index]  # (T, k) choices that cross
        L, wanted = self.limit(T), int(leaving.sum())
        if wanted > L:
            where = leaving.reshape(-1).nonzero().squeeze(1)  # token-major: t * k + j
            confidence = scores.softmax(dim=-1).gather(1, index).reshape(-1)[where]
            ranked = torch.sort(confidence, descending=True, stable=True).indices
            move = torch.zeros(T * k, dtype=torch.bool, device=scores.device)
            move[where[ranked[L:]]] = True
            move = move.reshape(T, k)
            index = index.clone()
            for j in range(k):  # re-pick in choice order, so a token never picks one expert twice
                tokens = move[:, j].nonzero().squeeze(1)
                if tokens.numel() == 0:
                    continue
                s = scores[tokens].clone()
                s[:, ~inside] = -math.inf
                s.scatter_(1, index[tokens], -math.inf)  # what the token already has
                index[tokens, j] = s.argmax(dim=-1)
        per_node = torch.bincount(node_of[index].reshape(-1), minlength=self.world // self.node_size)
        sent = T * k - int(per_node[self.node])
        self.last = {
            "node": self.node,
            "wanted": wanted,
            "limit": L,
            "sent": sent,
            "redirected": wanted - sent,
            "per_node": per_node.tolist(),
        }
        return index

    def record(self, routing: Routing) -> dict:
        """The last forward's counts (``last``) plus ``kept_sent``: the crossing choices that also fit
        the capacity, i.e. the rows the slow link actually carries."""
        inside = self.node_of_expert(routing.counts.device) == self.node
        return dict(self.last or {}, kept_sent=int(routing.kept_counts[~inside].sum()))


# ---------------------------------------------------------------------------------------------
# The layer's choice: this gate or the plain one (MoE's gate= option)
# ---------------------------------------------------------------------------------------------
def make_gate(gate: str, d_model, num_experts, top_k, capacity_factor, *, world, rank, nodes: dict, **options):
    """The MoE layer's gate: ``"topk"`` (``TopKGate``), or ``"topology"``: this gate, its nodes and links from
    ``nodes`` (node_size, bandwidth, local_bandwidth) or the emulated link (``machine.topology``)."""
    if gate != "topology":
        return TopKGate(d_model, num_experts, top_k, capacity_factor, **options)
    found = machine.topology(world, **nodes)
    return TopologyGate(
        d_model,
        num_experts,
        top_k,
        capacity_factor,
        world=world,
        rank=rank,
        node_size=found["node_size"],
        cross_fraction=found["cross_fraction"],
        **options,
    )
