"""The context-parallel group, and the places outside attention where its ranks talk: the loss, the logits, and an
MoE layer's load-balancing counts.

The loss. Rank c computes the mean loss L_c over its own tokens (the same number on every rank). The loss of the
sequence is their mean, (1/cp)·Σ_c L_c, and its gradient (1/cp)·Σ_c ∇L_c. The data-parallel strategy already
averages every gradient over its group, and under cp that group is dp x cp (the cp ranks hold the same
parameters and see different tokens, like dp ranks): so each rank must back-propagate its own L_c, nothing more.
`mean_over_cp` returns the mean over the cp ranks as the loss's value (what a student logs and compares with one
process), with the gradient of L_c (identity backward).

The load-balancing loss of an MoE layer (GShard's and Switch's, `toolkit.moe.losses`) is E·Σ_e f_e·P_e: f_e the
fraction of tokens whose first choice is expert e, P_e their mean router probability. It is not a mean over
tokens (a product of two means), so the mean of the cp ranks' losses on their own tokens is not the sequence's.
Megatron-core counts f over the whole sequence (`sequence_partition_group`, its tp x cp group): the counts are
summed over the cp ranks (`counts_over_cp`, E integers per layer), P_e stays this rank's. Then rank c's loss is
E·Σ_e f_e·P_e,c, and their mean over c, the one the gradients average, is the sequence's E·Σ_e f_e·P_e.
(Megatron sums the ranks' pieces and multiplies the aux loss's gradient by cp; here each rank's piece is a mean
over its tokens and the data-parallel average divides by cp: the same gradient.) The router z-loss is a mean
over tokens: it needs nothing.

The logits. `model(x)` returns the whole sequence's logits, as the unwrapped model does: each rank's are
all-gathered and put back in sequence order (`gather_sequence`; backward keeps this rank's part).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ... import comm
from .sequence import SequenceSplit


@dataclass(frozen=True)
class CPGroup:
    """This rank's context-parallel group: the process group, its size cp and this rank's index in it."""

    group: object
    size: int
    rank: int

    @classmethod
    def of(cls, group) -> CPGroup:
        ranks = comm.group_ranks(group)
        return cls(group, len(ranks), ranks.index(dist.get_rank()))


def labelled(calls, label: str, key: str = "cp") -> list:
    """Issue `calls` (each one call to `toolkit.comm`) and name on their spans what they carry (`args["cp"]`: "kv",
    "dkv", "ulysses", "loss", "logits", "moe balance"): the trace, a test or the simulator tells cp's traffic from
    the rest. `key`: another dimension's ring names its passes under its own ("tp": `tensor/overlap.py`)."""
    issued, results = [], []
    with comm.listening(lambda kind, event, tensor: issued.append(event) if kind == "issue" else None):
        for call in calls:
            results.append(call())
    for event in issued:
        event["args"][key] = label
    return results


class _MeanOverCP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss, cp: CPGroup):
        total = loss.detach().clone().contiguous()
        labelled([lambda: comm.all_reduce(total, op="avg", group=cp.group)], "loss")
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def mean_over_cp(loss: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """The mean of every cp rank's loss as the value; this rank's own loss's gradient (see the module's text)."""
    return _MeanOverCP.apply(loss, cp)


def counts_over_cp(counts: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """An MoE gate's first-choice counts per expert on this rank's tokens, summed over the cp ranks: the whole
    sequence's (see the module's text)."""
    total = counts.clone()
    labelled([lambda: comm.all_reduce(total, group=cp.group)], "moe balance")
    return total


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp: CPGroup, split: SequenceSplit):
        ctx.split = split
        x = x.contiguous()
        out = x.new_empty((cp.size,) + tuple(x.shape))
        labelled([lambda: comm.all_gather(out, x, group=cp.group)], "logits")
        return split.whole(list(out.unbind(0)))

    @staticmethod
    def backward(ctx, grad):
        return ctx.split.local(grad), None, None


def gather_sequence(x: torch.Tensor, cp: CPGroup, split: SequenceSplit) -> torch.Tensor:
    """The whole sequence of (batch, tokens, ...) tensors from every rank's tokens, in sequence order."""
    if x.dim() < 2:
        raise ValueError(f"gather_sequence takes (batch, tokens, ...) tensors, got shape {tuple(x.shape)}.")
    return _GatherSequence.apply(x, cp, split)
