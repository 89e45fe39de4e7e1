"""EP+DP+MP (Tutel's r): more ranks than experts, each expert sliced over the W/E ranks that hold it.

With W > E ranks, s = W/E ranks hold each expert: rank e*s + k keeps slice k of expert e's hidden
layer (d_ff/s columns of w1 and b1, rows of w2) and slice k of its output bias b2 (``Experts(shard=)``).
That storage never changes. How a step computes with it is Tutel's r (``expert_slices``, a divisor of
s): the expert runs as r slices of its hidden layer, and each slice is computed by a group of s/r ranks
that gather it from their storage slices and split the expert's rows among them:

    r = s (default)  EP+MP: every rank computes its own slice; no weight moves; every row travels to the
                     s ranks of its expert and comes back as s partial outputs that the sender adds up.
                     Tutel's O(C_g * W/E)
    r = 1            EP+DP: the s ranks all-gather the whole expert (a reduce-scatter returns its
                     gradient) and each computes it on 1/s of the rows: O(C_g + P/E)
    1 < r < s        both: O(C_g * r + P/E/r)

A hidden layer splits exactly: GELU acts on each hidden unit alone, so x -> GELU(x w1 + b1) w2 is the
sum over slices of the same map restricted to the slice's units. The output bias is added once: every
slice adds b2/r (b2 gathered from the expert's s ranks), and r slices are summed (Tutel does the same).
Which rows a rank of a group gets: each sender splits its rows for the expert into s/r contiguous,
near-equal parts (Tutel splits its padded capacity buffer by position instead).

Everything else is the plain layer: the count exchange, the uneven all-to-alls (or the 2DH one),
autograd through them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from .experts import WEIGHTS, GatherWeights, join_slices, predivided


def _positions(group) -> list:
    return comm.group_ranks(group) if dist.is_initialized() else [0]


def row_destinations(kept, world: int, num_experts: int, slices: int | None = None) -> list:
    """Rows one sender sends to each rank of the group, from its kept rows per expert ``kept`` (E).
    W <= E: expert e's rows go to its owner; W > E: to one rank of each of the r slice groups of e."""
    kept = [int(c) for c in kept]
    if world <= num_experts:
        per = num_experts // world
        return [sum(kept[q * per : (q + 1) * per]) for q in range(world)]
    s = world // num_experts
    size = s // (slices or s)  # ranks per slice group
    return [_part(kept[q // s], size, q % s % size) for q in range(world)]


def _part(rows: int, parts: int, j: int) -> int:
    return (j + 1) * rows // parts - j * rows // parts


class Slicing:
    """A layer's experts over W = E*s ranks computed as r slices (see the module doc)."""

    def __init__(self, world: int, num_experts: int, d_ff: int, slices=None):
        s = world // num_experts
        r = s if slices is None else slices
        if d_ff % s:
            raise ValueError(
                f"MoE: {world} ranks for {num_experts} expert(s) slice each expert's hidden layer "
                f"over {s} ranks, so d_ff={d_ff} must be a multiple of {s}."
            )
        if isinstance(r, bool) or not isinstance(r, int) or r < 1 or s % r:
            fits = [d for d in range(1, s + 1) if s % d == 0]
            raise ValueError(
                f"expert_slices={slices!r}: Tutel's r must divide the {s} ranks per expert; choose one "
                f"of {fits} (1 = EP+DP: whole experts, rows split; {s} = EP+MP: no weight moves)."
            )
        self.world, self.num_experts, self.s, self.r, self.size = world, num_experts, s, r, s // r
        self.d_ff, self.chosen = d_ff, slices is not None  # chosen: the user fixed r (auto may not change it)
        self._groups, self._family = None, {r: self}

    def __repr__(self) -> str:
        return f"Slicing({self.s} ranks per expert, r={self.r})"

    def with_slices(self, r: int) -> Slicing:
        """The same storage computed as ``r`` slices (Tutel's r switched at run time by
        ``expert_parallel="auto"``); one Slicing per r, so each r's groups are built once."""
        if r not in self._family:
            other = Slicing(self.world, self.num_experts, self.d_ff, r)
            other.chosen, other._family = self.chosen, self._family
            self._family[r] = other
        return self._family[r]

    def members(self, q: int) -> tuple[list, list]:
        """Positions of (position q's slice group, q's expert's ranks): who gathers weights with whom."""
        e, k = divmod(q, self.s)
        start = e * self.s + k // self.size * self.size
        return list(range(start, start + self.size)), list(range(e * self.s, (e + 1) * self.s))

    def groups(self, layer):
        """(my slice group, my expert's ranks) as process groups; built by their members only."""
        if self._groups is None:
            ranks = _positions(layer.group)
            self._groups = tuple(
                dist.new_group([ranks[q] for q in members], use_local_synchronization=True)
                for members in self.members(layer.rank)
            )
        return self._groups

    def send_counts(self, kept) -> torch.Tensor:
        """(W, 1): rows this rank sends to each rank (its kept rows per expert, copied r times)."""
        sends = row_destinations(kept.tolist(), self.world, self.num_experts, self.r)
        return torch.tensor(sends, dtype=kept.dtype, device=kept.device).reshape(self.world, 1)

    def copies(self, plan) -> torch.Tensor:
        """Index of the rows (sorted by expert) that fill the send buffer (sorted by destination rank):
        every row appears once per slice group."""
        sends = plan.send_counts.reshape(-1).tolist()
        per_expert = [sum(sends[e * self.s : e * self.s + self.size]) for e in range(self.num_experts)]
        starts = [sum(per_expert[:e]) for e in range(self.num_experts)]
        index = []
        for q, n in enumerate(sends):
            e, k = divmod(q, self.s)
            first = starts[e] + (k % self.size) * per_expert[e] // self.size
            index.append(torch.arange(first, first + n))
        return torch.cat(index) if index else torch.zeros(0, dtype=torch.long)

    def weights(self, layer):
        """(w1, b1, w2, b2 / r) of the slice this rank computes: its own slice, or its group's slices
        gathered (differentiable: a reduce-scatter sums their gradients back)."""
        ex = layer.experts
        own = [getattr(ex, n)[0] for n in WEIGHTS]
        if not dist.is_initialized():
            return own[0], own[1], own[2], own[3][: layer.d_model] / self.r
        group, expert = self.groups(layer)
        w1, b1, w2 = own[:3]
        if self.size == 1:  # EP+MP: the storage slice is the slice computed (experts.predivided)
            w1, b1, w2 = (predivided(getattr(ex, n))[0] for n in WEIGHTS[:3])
        else:  # EP+DP: the group's storage slices make the slice it computes
            flat = torch.cat([w.reshape(-1) for w in (w1, b1, w2)])
            everyone = GatherWeights.apply(flat, group, self.size, "slice weights", (ex.w1, ex.b1, ex.w2))
            everyone = everyone.reshape(self.size, -1)
            parts, at = [], 0
            for name, w in zip(WEIGHTS, (w1, b1, w2)):
                stacked = everyone[:, at : at + w.numel()].reshape((self.size,) + tuple(w.shape))
                parts.append(join_slices(stacked, name, self.size, layer.d_model)[0])
                at += w.numel()
            w1, b1, w2 = parts
        b2 = GatherWeights.apply(own[3], expert, self.s, "output bias", (ex.b2,))[: layer.d_model]
        return w1, b1, w2, b2 / self.r
