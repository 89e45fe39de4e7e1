"""Cross-entropy on logits split by vocabulary: the loss without any rank holding the full logits.

Rank r holds z[:, r·V/t : (r+1)·V/t] for N tokens. The loss of a token with target y is

    loss = log Σ_v exp(z_v) - z_y = log Σ_v exp(z_v - m) - (z_y - m)        (m: the max, for stability)

and every piece of it is a sum or a max over the vocabulary, so each rank computes its part and three
all-reduces of N numbers (not N·V) finish it (Megatron's _VocabParallelCrossEntropy):

    1. m      = all_reduce_max(max of my logits)              per token
    2. z_y-m  = all_reduce_sum(my logit of y if y is mine, else 0)
    3. Σ exp  = all_reduce_sum(Σ of exp(my logits - m))

Backward needs no talk at all: d loss / d z_v = softmax(z)_v - [v = y], and each rank has its own
softmax entries (exp(z_v - m) / Σ exp) and knows whether y is among its words. The softmax of the local
slice is kept for backward, (N, V/t) in fp32, and backward turns it into the gradient in place (Megatron's
_VocabParallelCrossEntropy does the same): the largest activation of a small model is never held twice.
The computation is fp32 whatever the logits' dtype.
"""

from __future__ import annotations

import torch

from ... import comm
from .operators import TPGroup, labelled


def _all_reduce(x: torch.Tensor, tp: TPGroup, op: str, label: str) -> torch.Tensor:
    labelled(lambda: comm.all_reduce(x, op=op, group=tp.group), label)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp: TPGroup, vocab):
        z = logits.float()
        width = z.shape[-1]
        start = tp.rank * width
        if vocab is not None and start + width > vocab:  # a padded vocabulary's last columns are no words: their
            padding = torch.arange(start, start + width, device=z.device) >= vocab  # exp is 0, so is their gradient
            z = z.masked_fill(padding, float("-inf"))
        m = _all_reduce(z.max(dim=-1).values.clone(), tp, "max", "cross-entropy max")  # 1
        z = z - m.unsqueeze(-1)
        outside = (target < start) | (target >= start + width)
        local = (target - start).masked_fill(outside, 0)
        target_logit = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        target_logit = _all_reduce(target_logit, tp, "sum", "cross-entropy target logit")  # 2
        exp = z.exp()
        sum_exp = _all_reduce(exp.sum(dim=-1), tp, "sum", "cross-entropy sum of exp")  # 3
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, outside)  # my softmax slice
        ctx.dtype = logits.dtype
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        # the gradient is written into the saved softmax itself, as Megatron's does: no second (N, V/t) fp32
        # buffer (nor a third for the product). The softmax is not needed again, and a second backward through
        # this graph (retain_graph=True) is refused by autograd, which sees the saved tensor modified.
        grad_logits, local, outside = ctx.saved_tensors
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), -(~outside).to(grad_logits.dtype).unsqueeze(-1))
        return grad_logits.mul_(grad.unsqueeze(-1)).to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, tp: TPGroup, vocab: int | None = None
) -> torch.Tensor:
    """Mean cross-entropy of (..., V/t) logits split by vocabulary against (...) targets. vocab: the number of
    real words when the split vocabulary was padded (`shards.py`); the columns beyond it are left out."""
    flat = logits.reshape(-1, logits.shape[-1])
    return _VocabParallelCrossEntropy.apply(flat, target.reshape(-1), tp, vocab).mean()
