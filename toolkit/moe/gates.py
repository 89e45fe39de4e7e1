"""The gate of a Mixture-of-Experts layer: which expert sees which token, and with what weight.

An MoE layer replaces one feed-forward block by E experts and a small router. For every token the
router scores all experts, the gate keeps the k best, and the layer sends the token only there. That
makes compute per token constant while parameters grow with E, at two prices that this file is about:

1. Capacity. All-to-all needs fixed shapes, so every expert gets a buffer of C slots,
   C = ceil(k * f * T / E) (GShard; Tutel rounds differently: `moe/capacity.py`). Tokens beyond an
   expert's C are dropped (they skip the layer through the residual connection). f > 1 buys slack
   against imbalance with memory and traffic.
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
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .capacity import _is_int, _is_real, capacity, tutel_capacity  # noqa: F401 - the arithmetic (moe/capacity.py)
from .losses import gshard_aux_loss, router_z_loss, switch_aux_loss
from .routing import Routing, _slots  # noqa: F401 - the decision's record (moe/routing.py)

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
# The gate module (capacity: moe/capacity.py; the Routing record and its slots: moe/routing.py)
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

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        top_k: int = 2,
        capacity_factor: float = 1.25,
        *,
        noisy: bool = False,
        noise_std: float = 1.0,
        normalize_topk: bool = True,
        dropless: bool = False,
        z_loss_weight: float = 0.0,
        aux_loss: str = "gshard",
        min_capacity: int = 1,
    ):
        super().__init__()
        if not _is_int(d_model) or d_model < 1:
            raise ValueError(f"d_model must be an int >= 1, got {d_model!r}.")
        capacity(0, num_experts, top_k, capacity_factor, min_capacity)  # validates all four
        if aux_loss not in AUX_LOSSES:
            raise ValueError(f"aux_loss={aux_loss!r} is not known; choose one of {list(AUX_LOSSES)}.")
        if not (_is_real(noise_std) and noise_std >= 0):
            raise ValueError(f"noise_std must be a finite number >= 0, got {noise_std!r}.")
        if not (_is_real(z_loss_weight) and z_loss_weight >= 0):
            raise ValueError(
                f"z_loss_weight must be a finite number >= 0 (0 disables the z-loss; "
                f"ST-MoE uses 1e-3), got {z_loss_weight!r}."
            )
        self.d_model, self.num_experts, self.top_k = d_model, num_experts, top_k
        self.capacity_factor, self.min_capacity = capacity_factor, min_capacity
        self.noisy, self.noise_std = bool(noisy), float(noise_std)
        self.normalize_topk, self.dropless = bool(normalize_topk), bool(dropless)
        self.z_loss_weight, self.aux_loss = float(z_loss_weight), aux_loss
        self.router = nn.Linear(d_model, num_experts, bias=False)
        # fn(this rank's first-choice counts) -> the counts over every token the loss balances, when this rank
        # holds a part of each sequence (context parallelism sets it: `toolkit.parallel.context.model`)
        self.balance_over = None

    def extra_repr(self) -> str:
        cap = "dropless" if self.dropless else f"capacity_factor={self.capacity_factor}"
        return (
            f"d_model={self.d_model}, num_experts={self.num_experts}, top_k={self.top_k}, {cap}, "
            f"aux_loss={self.aux_loss!r}, noisy={self.noisy}, z_loss_weight={self.z_loss_weight}"
        )

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """(T, k) expert ids, best first, from (T, E) scores: the top-k. Other gates override this
        one decision (``TopologyGate`` keeps most tokens inside their node); weights, slots, capacity
        and losses then follow from whatever was chosen."""
        return scores.topk(self.top_k, dim=-1).indices

    def forward(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> Routing:
        if x.dim() != 2 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"TopKGate expects tokens of shape (T, d_model={self.d_model}), got "
                f"{tuple(x.shape)}. Flatten batch and sequence first: x.reshape(-1, {self.d_model})."
            )
        T, E, k = x.shape[0], self.num_experts, self.top_k

        # 1. Score every expert (float32 for stable routing) and turn scores into probabilities.
        logits = F.linear(x.float(), self.router.weight.float())  # (T, E)
        probs = logits.softmax(dim=-1)

        # 2. Choose the top-k, optionally on noisy scores (training only).
        scores = logits
        if self.noisy and self.training and self.noise_std > 0:
            noise = torch.randn(logits.shape, generator=generator, device=logits.device, dtype=logits.dtype)
            scores = logits + self.noise_std * noise
        expert_index = self.choose(scores.detach()) if _assumed is None else _assumed(T, E, k)  # (T, k)
        gate_weight = probs.gather(1, expert_index.to(probs.device))  # (T, k)
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
        first = expert_index[:, 0]
        whole = None if self.balance_over is None else self.balance_over(torch.bincount(first, minlength=E))
        aux = loss_fn(probs, first, counts=whole)
        z = self.z_loss_weight * router_z_loss(logits) if self.z_loss_weight > 0 else None

        return Routing(
            expert_index=expert_index,
            gate_weight=gate_weight,
            slot=slot,
            kept=slot < cap,
            counts=counts,
            kept_counts=counts.clamp(max=cap),
            capacity=cap,
            aux_loss=aux,
            z_loss=z,
        )


def load_stats(counts: torch.Tensor | Sequence[int]) -> dict:
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
