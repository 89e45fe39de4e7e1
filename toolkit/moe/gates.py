"""The gate of a Mixture-of-Experts layer: which expert sees which token, and with what weight.

An MoE layer replaces one feed-forward block by E experts and a small router. For every token the
router scores all experts, the gate keeps the k best, and the layer sends the token only there. That
makes compute per token constant while parameters grow with E, at two prices that this file is about:

1. Capacity. All-to-all needs fixed shapes, so every expert gets a buffer of C slots,
   C = ceil(k * f * T / E) (GShard). Tokens beyond an expert's C are dropped (they skip the layer
   through the residual connection). f > 1 buys slack against imbalance with memory and traffic.
2. Balance. Nothing stops the router from sending everything to one expert (one busy GPU, the rest
   idle, most tokens dropped). An auxiliary loss pushes the router toward an even load
   (GShard, Switch), and the router z-loss keeps its logits small so the softmax stays stable
   (ST-MoE).

Everything here is single-process math on the tokens of one rank; no collective is issued. The layer
(`moe/layer.py`) calls the gate, then dispatches with all-to-all. In the order a lecture tells it:

    logits = x @ W_router                       (T, E)   scores
    probs  = softmax(logits)                    (T, E)   a distribution over experts
    expert_index, gate_weight = top-k(probs)    (T, k)   the decision
    slot = position of the token in its expert's buffer, first choices before second choices
    kept = slot < capacity                      (T, k)   what fits
    aux_loss, z_loss                                     what teaches the router to balance (moe/losses.py)

``TopologyGate`` (FasterMoE, in `moe/topology.py`) changes only the decision: at most L rows per
worker may leave its node, the rest re-pick inside it.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from dataclasses import dataclass, replace
from typing import Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from .losses import gshard_aux_loss, router_z_loss, switch_aux_loss

__all__ = [
    "capacity",
    "Routing",
    "TopKGate",
    "gshard_aux_loss",
    "switch_aux_loss",
    "router_z_loss",
    "load_stats",
    "AUX_LOSSES",
]

AUX_LOSSES = ("gshard", "switch")


# ---------------------------------------------------------------------------------------------
# 1. Capacity: how many tokens one expert accepts
# ---------------------------------------------------------------------------------------------

def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float,
             min_capacity: int = 1) -> int:
    """Slots per expert buffer: ``max(ceil(k * f * T / E), min_capacity)``.

    With perfect balance each expert receives k*T/E tokens; ``capacity_factor`` f is the slack on top.
    The result depends only on these numbers, so every rank that routes the same number of tokens
    computes the same C and the all-to-all shapes agree without a collective.

    A tiny tolerance absorbs float error (1 * 1.1 * 10 / 11 is 1.0000000000000002 in floating point
    and must give 1, not 2).
    """
    if not _is_int(num_tokens) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an int >= 0 (tokens routed on this rank), got {num_tokens!r}.")
    if not _is_int(num_experts) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}.")
    if not _is_int(top_k) or top_k < 1:
        raise ValueError(f"top_k must be an int >= 1 (experts per token), got {top_k!r}.")
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} is larger than num_experts={num_experts}: a token cannot pick "
                         f"more distinct experts than exist. Use top_k <= {num_experts}.")
    if not _is_real(capacity_factor) or capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be a finite number > 0 (1.0 = exactly the balanced "
                         f"load, 1.25 is common), got {capacity_factor!r}. For no dropping at all, "
                         f"use dropless=True instead of a huge factor.")
    if not _is_int(min_capacity) or min_capacity < 0:
        raise ValueError(f"min_capacity must be an int >= 0, got {min_capacity!r}.")
    c = math.ceil(int(top_k) * float(capacity_factor) * int(num_tokens) / int(num_experts) - 1e-9)
    return max(c, int(min_capacity))


# ---------------------------------------------------------------------------------------------
# 2. The decision: a Routing record
# ---------------------------------------------------------------------------------------------

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
    z_loss: Optional[torch.Tensor] = None

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

    def with_capacity(self, capacity: int) -> "Routing":
        """The same decision with another capacity: only ``kept`` and ``kept_counts`` change.

        This is how the layer applies a capacity agreed across ranks. In dropless mode each rank's
        capacity is its own max count; the expert-parallel layer must all-reduce(MAX) that number
        over the group and call ``routing.with_capacity(global_max)`` so that every rank's
        all-to-all buffers have the same (E, C, d) shape.
        """
        if not _is_int(capacity) or capacity < 0:
            raise ValueError(f"capacity must be an int >= 0 (slots per expert), got {capacity!r}. "
                             f"If it came from an all-reduce, convert with int(tensor.item()).")
        return replace(self, capacity=capacity, kept=self.slot < capacity,
                       kept_counts=self.counts.clamp(max=capacity))

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
        out = torch.zeros(self.num_tokens, self.num_experts, self.capacity, dtype=torch.bool,
                          device=self.expert_index.device)
        out[t, e, s] = True
        return out


def _slots(expert_index: torch.Tensor, num_experts: int):
    """Buffer positions in GShard order: choice 0 of every token (in token order), then choice 1, ...

    Lay the (T, k) choices out choice-major as (k*T,), one-hot them to (k*T, E), and a running sum
    down the column of expert e counts how many earlier choices also went to e: that is the slot.
    """
    T, k = expert_index.shape
    onehot = F.one_hot(expert_index.t().reshape(-1), num_experts)            # (k*T, E)
    position = onehot.cumsum(dim=0) - 1                                       # running count - 1
    slot = (position * onehot).sum(dim=-1).reshape(k, T).t().contiguous()     # back to (T, k)
    counts = onehot.sum(dim=0)                                                # (E,)
    return slot, counts


# ---------------------------------------------------------------------------------------------
# 3. The gate module
# ---------------------------------------------------------------------------------------------

_assumed = None  # fn(num_tokens, num_experts, top_k) -> (T, k) expert ids: see `assume_routing`


@contextlib.contextmanager
def assume_routing(decide):
    """Inside, every gate takes its choice of experts from ``decide(T, E, k)`` instead of its scores.

    The weights, slots, capacity and losses still follow from that choice as usual. It is how a
    simulated rank routes (``toolkit.sim``: its tokens are meta tensors, with no values to score), and
    a way to ask "what if the load were exactly this?" of a real layer.
    """
    global _assumed
    before, _assumed = _assumed, decide
    try:
        yield
    finally:
        _assumed = before


class TopKGate(nn.Module):
    """Top-k softmax gate with capacity (GShard / Switch), optional noise, dropless mode and z-loss.

    Args:
        d_model, num_experts: the router is a bias-free ``Linear(d_model, num_experts)``.
        top_k: experts per token (1 = Switch, 2 = GShard).
        capacity_factor: slack f in C = ceil(k * f * T / E); ignored when ``dropless``.
        noisy, noise_std: in training mode, add N(0, noise_std**2) to the logits before choosing the
            top-k (exploration, helps early balance). The noise changes only *which* experts win;
            the weights come from the clean softmax. Eval mode never adds noise. The noise is drawn
            from the ``generator`` passed to ``forward`` if any, else from torch's global RNG (seed
            it, e.g. ``torch.manual_seed``, for repeatable runs).
        normalize_topk: for k > 1, rescale the k chosen probabilities to sum to 1 (GShard). Top-1
            always uses the raw probability (Switch), otherwise the weight would be 1 and the router
            would get no gradient from the task loss.
        dropless: never drop: capacity = this rank's largest count. Across expert-parallel ranks the
            layer must all-reduce(MAX) ``routing.capacity`` and apply it with
            ``routing.with_capacity(c)`` so all all-to-all shapes agree.
        z_loss_weight: weight of the router z-loss; 0 disables it (``routing.z_loss`` is None).
        aux_loss: "gshard" (unweighted, 1.0 at balance: scale it yourself) or "switch" (alpha=0.01
            built in, 0.01 at balance).
        min_capacity: lower bound for C, so that small batches still get a slot per expert.

    The logits and softmax are computed in float32 whatever the input dtype: near-ties in bf16 flip
    expert choices and make runs irreproducible.
    """

    def __init__(self, d_model: int, num_experts: int, top_k: int = 2, capacity_factor: float = 1.25, *,
                 noisy: bool = False, noise_std: float = 1.0, normalize_topk: bool = True,
                 dropless: bool = False, z_loss_weight: float = 0.0, aux_loss: str = "gshard",
                 min_capacity: int = 1):
        super().__init__()
        if not _is_int(d_model) or d_model < 1:
            raise ValueError(f"d_model must be an int >= 1, got {d_model!r}.")
        capacity(0, num_experts, top_k, capacity_factor, min_capacity)  # validates all four
        if aux_loss not in AUX_LOSSES:
            raise ValueError(f"aux_loss={aux_loss!r} is not known; choose one of {list(AUX_LOSSES)}.")
        if not (_is_real(noise_std) and noise_std >= 0):
            raise ValueError(f"noise_std must be a finite number >= 0, got {noise_std!r}.")
        if not (_is_real(z_loss_weight) and z_loss_weight >= 0):
            raise ValueError(f"z_loss_weight must be a finite number >= 0 (0 disables the z-loss; "
                             f"ST-MoE uses 1e-3), got {z_loss_weight!r}.")
        self.d_model, self.num_experts, self.top_k = d_model, num_experts, top_k
        self.capacity_factor, self.min_capacity = capacity_factor, min_capacity
        self.noisy, self.noise_std = bool(noisy), float(noise_std)
        self.normalize_topk, self.dropless = bool(normalize_topk), bool(dropless)
        self.z_loss_weight, self.aux_loss = float(z_loss_weight), aux_loss
        self.router = nn.Linear(d_model, num_experts, bias=False)

    def extra_repr(self) -> str:
        cap = "dropless" if self.dropless else f"capacity_factor={self.capacity_factor}"
        return (f"d_model={self.d_model}, num_experts={self.num_experts}, top_k={self.top_k}, {cap}, "
                f"aux_loss={self.aux_loss!r}, noisy={self.noisy}, z_loss_weight={self.z_loss_weight}")

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """(T, k) expert ids, best first, from (T, E) scores: the top-k. Other gates override this
        one decision (``TopologyGate`` keeps most tokens inside their node); weights, slots, capacity
        and losses then follow from whatever was chosen."""
        return scores.topk(self.top_k, dim=-1).indices

    def forward(self, x: torch.Tensor, *, generator: Optional[torch.Generator] = None) -> Routing:
        if x.dim() != 2 or x.shape[-1] != self.d_model:
            raise ValueError(f"TopKGate expects tokens of shape (T, d_model={self.d_model}), got "
                             f"{tuple(x.shape)}. Flatten batch and sequence first: x.reshape(-1, {self.d_model}).")
        T, E, k = x.shape[0], self.num_experts, self.top_k

        # 1. Score every expert (float32 for stable routing) and turn scores into probabilities.
        logits = F.linear(x.float(), self.router.weight.float())                       # (T, E)
        probs = logits.softmax(dim=-1)

        # 2. Choose the top-k, optionally on noisy scores (training only).
        scores = logits
        if self.noisy and self.training and self.noise_std > 0:
            noise = torch.randn(logits.shape, generator=generator, device=logits.device, dtype=logits.dtype)
            scores = logits + self.noise_std * noise
        expert_index = self.choose(scores.detach()) if _assumed is None else _assumed(T, E, k)  # (T, k)
        gate_weight = probs.gather(1, expert_index.to(probs.device))                   # (T, k)
        if self.normalize_topk and k > 1:
            gate_weight = gate_weight / gate_weight.sum(dim=-1, keepdim=True).clamp_min(1e-9)

        # 3. Give each choice a slot in its expert's buffer, then keep what fits the capacity.
        slot, counts = _slots(expert_index, E)
        if self.dropless:
            cap = max(int(counts.max()) if T > 0 else 0, self.min_capacity)
        else:
            cap = capacity(T, E, k, self.capacity_factor, self.min_capacity)

        # 4. The losses that teach balance (computed on the clean probabilities, first choices).
        loss_fn = gshard_aux_loss if self.aux_loss == "gshard" else switch_aux_loss
        aux = loss_fn(probs, expert_index[:, 0])
        z = self.z_loss_weight * router_z_loss(logits) if self.z_loss_weight > 0 else None

        return Routing(expert_index=expert_index, gate_weight=gate_weight, slot=slot,
                       kept=slot < cap, counts=counts, kept_counts=counts.clamp(max=cap),
                       capacity=cap, aux_loss=aux, z_loss=z)


def load_stats(counts: Union[torch.Tensor, Sequence[int]]) -> dict:
    """Imbalance of per-expert token counts, as plain floats (JSON-ready for a Run).

    max_over_mean  busiest expert / average: 1.0 is perfect balance, E means one expert takes all.
                   The step waits for the busiest expert, so this is roughly the slowdown vs balance.
    cv             coefficient of variation, std / mean (population std): 0.0 is perfect balance.
    Also: total, mean, max, min, num_experts, idle (experts that received nothing).
    With no tokens at all the load is called balanced (max_over_mean 1.0, cv 0.0).
    """
    c = torch.as_tensor(counts).detach().to("cpu", torch.float64).reshape(-1)
    if c.numel() == 0:
        raise ValueError("load_stats needs one count per expert; got an empty sequence.")
    if bool((c < 0).any()):
        raise ValueError(f"load_stats: counts must be >= 0 (tokens per expert), got {c.tolist()}.")
    total, mean, mx = float(c.sum()), float(c.mean()), float(c.max())
    balanced = mean == 0
    return {
        "num_experts": int(c.numel()),
        "total": total,
        "mean": mean,
        "max": mx,
        "min": float(c.min()),
        "max_over_mean": 1.0 if balanced else mx / mean,
        "cv": 0.0 if balanced else float(c.std(unbiased=False)) / mean,
        "idle": int((c == 0).sum()),
    }
