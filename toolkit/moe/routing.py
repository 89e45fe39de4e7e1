"""The gate's decision for the tokens of one rank: a ``Routing`` record, and the slots it gives each choice.

The gate (``moe/gates.py``) scores and chooses; this file holds what it decided: the experts, their
weights, each choice's position (slot) in its expert's buffer and whether it fits the capacity
(``moe/capacity.py``), plus the dense teaching forms of dispatch and combine (GShard's einsum masks).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .capacity import _is_int


@dataclass
class Routing:
    """What the gate decided for T tokens with top-k routing over E experts.

    expert_index (T, k) long    the chosen experts, best first
    gate_weight  (T, k) float   their weights in the combine (differentiable wrt the router);
                                not zeroed for dropped choices: multiply by ``kept`` (or use
                                ``combine_weights``) when combining
    slot         (T, k) long    position in the expert's buffer. Slots are given in token order, all
                                first choices before any second choice (GShard), so a token loses its
                                second expert before any token loses its first. Slots do not depend
                                on the capacity; they run 0..counts[e]-1 within expert e.
    kept         (T, k) bool    slot < capacity (what fits the buffer)
    counts       (E,)   long    choices routed to each expert, before capacity
    kept_counts  (E,)   long    after capacity: min(counts, capacity)
    capacity     int            slots per expert buffer
    aux_loss     scalar         load-balancing loss (differentiable)
    z_loss       scalar|None    router z-loss already times its weight, or None when disabled
    """

    expert_index: torch.Tensor
    gate_weight: torch.Tensor
    slot: torch.Tensor
    kept: torch.Tensor
    counts: torch.Tensor
    kept_counts: torch.Tensor
    capacity: int
    aux_loss: torch.Tensor
    z_loss: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.expert_index.shape[0]

    @property
    def top_k(self) -> int:
        return self.expert_index.shape[1]

    @property
    def num_experts(self) -> int:
        return self.counts.shape[0]

    @property
    def dropped(self) -> int:
        """How many (token, choice) pairs did not fit (out of T*k)."""
        return int((~self.kept).sum())

    @property
    def loss(self) -> torch.Tensor:
        """aux_loss + z_loss (if any): the extra term to add to the training loss."""
        return self.aux_loss if self.z_loss is None else self.aux_loss + self.z_loss

    def with_capacity(self, capacity: int) -> Routing:
        """The same decision with another capacity: only ``kept`` and ``kept_counts`` change.

        This is how the layer applies a capacity agreed across ranks. In dropless mode each rank's
        capacity is its own max count; the expert-parallel layer must all-reduce(MAX) that number
        over the group and call ``routing.with_capacity(global_max)`` so that every rank's
        all-to-all buffers have the same (E, C, d) shape.
        """
        if not _is_int(capacity) or capacity < 0:
            raise ValueError(
                f"capacity must be an int >= 0 (slots per expert), got {capacity!r}. "
                f"If it came from an all-reduce, convert with int(tensor.item())."
            )
        return replace(self, capacity=capacity, kept=self.slot < capacity, kept_counts=self.counts.clamp(max=capacity))

    def buffer_index(self) -> torch.Tensor:
        """(T, k) long: row of each choice in the flattened (E * C) expert buffer, -1 where dropped.

        The efficient dispatch: ``buf = x.new_zeros(E * C, d); buf[idx[kept]] = x[token_of_choice]``.
        """
        idx = self.expert_index * self.capacity + self.slot
        return torch.where(self.kept, idx, torch.full_like(idx, -1))

    def _kept_triples(self):
        t = torch.arange(self.num_tokens, device=self.expert_index.device)
        t = t[:, None].expand_as(self.expert_index)
        k = self.kept
        return t[k], self.expert_index[k], self.slot[k]

    def combine_weights(self) -> torch.Tensor:
        """(T, E, C) float: gate weight of token t in slot c of expert e, 0 elsewhere.

        The dense teaching form of GShard: ``dispatched = einsum('tec,td->ecd', dispatch_mask, x)``
        and ``y = einsum('tec,ecd->td', combine_weights, expert_out)``. It costs O(T*E*C) memory,
        fine for a lesson or a reference check, wasteful in a real layer (use ``buffer_index``).
        Differentiable wrt the router through ``gate_weight``.
        """
        t, e, s = self._kept_triples()
        out = self.gate_weight.new_zeros(self.num_tokens, self.num_experts, self.capacity)
        return out.index_put((t, e, s), self.gate_weight[self.kept], accumulate=True)

    def dispatch_mask(self) -> torch.Tensor:
        """(T, E, C) bool: True where token t occupies slot c of expert e. Dense teaching form, O(T*E*C)."""
        t, e, s = self._kept_triples()
        out = torch.zeros(
            self.num_tokens, self.num_experts, self.capacity, dtype=torch.bool, device=self.expert_index.device
        )
        out[t, e, s] = True
        return out


def _slots(expert_index: torch.Tensor, num_experts: int):
    """Buffer positions in GShard order: choice 0 of every token (in token order), then choice 1, ...

    Lay the (T, k) choices out choice-major as (k*T,), one-hot them to (k*T, E), and a running sum
    down the column of expert e counts how many earlier choices also went to e: that is the slot.
    """
    T, k = expert_index.shape
    onehot = F.one_hot(expert_index.t().reshape(-1), num_experts)  # (k*T, E)
    position = onehot.cumsum(dim=0) - 1  # running count - 1
    slot = (position * onehot).sum(dim=-1).reshape(k, T).t().contiguous()  # back to (T, k)
    counts = onehot.sum(dim=0)  # (E,)
    return slot, counts
