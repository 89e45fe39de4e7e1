"""The losses that teach an MoE router to balance its load (pure functions of the gate's probabilities).

Nothing stops a router from sending every token to one expert: one busy rank, the rest idle, most tokens
dropped. GShard's and Switch's auxiliary losses grow when the fraction of tokens an expert gets and its mean
probability are both high, pushing the router toward an even load; ST-MoE's router z-loss keeps the logits
small so the softmax stays stable.
"""

from __future__ import annotations

import torch

__all__ = ["gshard_aux_loss", "switch_aux_loss", "router_z_loss"]


def _check_probs(probs: torch.Tensor, top1_index: torch.Tensor, name: str) -> None:
    if probs.dim() != 2:
        raise ValueError(f"{name}: probs must be (tokens, experts), got shape {tuple(probs.shape)}.")
    if top1_index.shape != probs.shape[:1]:
        raise ValueError(
            f"{name}: top1_index must be (tokens,) = ({probs.shape[0]},) holding each token's "
            f"first-choice expert, got shape {tuple(top1_index.shape)}. "
            f"Pass expert_index[:, 0], not the whole (T, k) index."
        )


def _fraction_and_mean_prob(probs: torch.Tensor, top1_index: torch.Tensor, counts=None):
    """f_e: fraction of tokens whose first choice is e (no gradient: it is a count), from `counts` when given
    (first choices counted over more tokens than these: context parallelism's whole sequence);
    P_e: mean router probability of e (differentiable: this is where the gradient goes)."""
    E = probs.shape[1]
    if counts is None:
        counts = torch.bincount(top1_index, minlength=E)
    counts = counts.to(probs.device, probs.dtype)
    return counts / counts.sum().clamp_min(1), probs.mean(dim=0)


def gshard_aux_loss(probs: torch.Tensor, top1_index: torch.Tensor, counts=None) -> torch.Tensor:
    """GShard's load-balancing loss: ``mean_e(c_e/S * m_e) * E**2``.

    c_e/S is the fraction of the S tokens whose first choice is expert e, m_e the mean gate
    probability of e. The counts are not differentiable, so the gradient flows through m_e: it lowers
    the probability of experts that are already crowded. Scaled by E**2 the loss is 1.0 at perfect
    balance and E when one expert takes everything; multiply by your own weight (e.g. 0.01).
    `counts` (E,): the first choices counted over every token the loss balances, when these are a part of
    them (context parallelism: each rank holds 1/cp of each sequence, and Megatron counts over all of it).
    """
    _check_probs(probs, top1_index, "gshard_aux_loss")
    if probs.shape[0] == 0:
        return probs.sum() * 0.0
    E = probs.shape[1]
    frac, mean_prob = _fraction_and_mean_prob(probs, top1_index, counts)
    return (frac * mean_prob).mean() * E * E


def switch_aux_loss(probs: torch.Tensor, top1_index: torch.Tensor, alpha: float = 0.01, counts=None) -> torch.Tensor:
    """Switch Transformer's load-balancing loss: ``alpha * E * sum_e f_e * P_e``.

    The same quantity as GShard's (E * sum = E**2 * mean), already scaled by alpha = 0.01 as in the
    paper, so it is 0.01 at perfect balance. `counts`: as for ``gshard_aux_loss``.
    """
    _check_probs(probs, top1_index, "switch_aux_loss")
    if probs.shape[0] == 0:
        return probs.sum() * 0.0
    E = probs.shape[1]
    frac, mean_prob = _fraction_and_mean_prob(probs, top1_index, counts)
    return alpha * E * (frac * mean_prob).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: ``mean over tokens of logsumexp(logits)**2``.

    Large logits make the softmax (and bf16 arithmetic) brittle; this penalises their overall size
    without caring which expert wins. Unweighted: the gate multiplies by ``z_loss_weight``.
    """
    if logits.dim() != 2:
        raise ValueError(f"router_z_loss: logits must be (tokens, experts), got shape {tuple(logits.shape)}.")
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    return torch.logsumexp(logits, dim=-1).pow(2).mean()
