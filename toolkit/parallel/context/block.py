"""Attention of a block of queries over a block of keys, returning what the merge needs: the output and its lse.

The fused kernel is the one `F.scaled_dot_product_attention` runs (FlashAttention's algorithm; on this machine
its CPU port, `aten._scaled_dot_product_flash_attention_for_cpu`, which the simulator prices as an attention
kernel): it never materialises the (queries x keys) scores and returns, beside the output, the log-sum-exp of
each query's scores. Its backward takes the output and the lse and recomputes the scores block by block.

Ring attention's backward relies on one property of that backward: given the *final* output and lse (over all
the keys) instead of a block's own, it returns exactly this block's share of the gradients (dS = P ∘ (dP - D)
with P = e^(S - lse) and D = rowsum(dO ∘ O), both global). So each rank can compute, block by block, the
gradients a single process would get from the whole sequence, as Megatron and torch do.

Elsewhere (a GPU, whose fused kernels have other signatures) the same two functions run in plain tensor
algebra, which is exact and slower: the scores of one block pair are materialised for the duration of a call.

Grouped-query attention: k and v may hold fewer heads than q (n_kv_head, each shared by a group of query heads).
They travel compact, and are repeated here only, for the block's kernel; backward sums each repeated head's
gradient over its group, so the gradient of a block's keys and values travels compact too.
"""

from __future__ import annotations

import math

import torch

from ...models.gpt import repeat_kv

aten = torch.ops.aten


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None = None):
    """(out, lse) of queries q over keys k and values v, each (batch, heads, tokens, head_dim); causal: query i
    sees keys 0..i (the two blocks hold the same positions). k and v may have fewer heads (grouped-query)."""
    heads = q.shape[1]
    return (fused_attend if q.device.type in FUSED else plain_attend)(
        q, repeat_kv(k, heads), repeat_kv(v, heads), causal, scale
    )


def attend_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float | None = None):
    """(dq, dk, dv) of this block, given the gradient of the final output, and the final output and lse."""
    backward = fused_attend_backward if q.device.type in FUSED else plain_attend_backward
    heads = q.shape[1]
    dq, dk, dv = backward(grad_out, q, repeat_kv(k, heads), repeat_kv(v, heads), out, lse, causal, scale)
    return dq, _sum_groups(dk, k.shape[1]), _sum_groups(dv, v.shape[1])


def _sum_groups(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of compact keys (or values) from that of their repeated heads: each group's sum."""
    B, heads, T, d = grad.shape
    return grad if heads == kv_heads else grad.view(B, kv_heads, heads // kv_heads, T, d).sum(2)


FUSED = ("cpu", "meta")  # devices whose fused kernel is called here (the simulator's meta tensors take the CPU's)


def fused_attend(q, k, v, causal, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def fused_attend_backward(grad_out, q, k, v, out, lse, causal, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, causal, scale=scale
    )


def plain_attend(q, k, v, causal, scale):
    p, lse = _probabilities(q, k, causal, scale)
    return (p @ v.to(p.dtype)).to(q.dtype), lse


def plain_attend_backward(grad_out, q, k, v, out, lse, causal, scale):
    p, _ = _probabilities(q, k, causal, scale, lse)
    g, o = grad_out.to(p.dtype), out.to(p.dtype)
    dv = p.transpose(-1, -2) @ g
    dp = g @ v.to(p.dtype).transpose(-1, -2)
    ds = p * (dp - (g * o).sum(-1, keepdim=True)) * _scale(q, scale)
    return (ds @ k.to(p.dtype)).to(q.dtype), (ds.transpose(-1, -2) @ q.to(p.dtype)).to(k.dtype), dv.to(v.dtype)


def accumulator(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results are merged and gradients summed in: fp32 (fp64 for fp64 inputs), as the lse is."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scale(q, scale):
    return 1 / math.sqrt(q.shape[-1]) if scale is None else scale


def _probabilities(q, k, causal, scale, lse=None):
    """e^(S - lse) for the block's scores S (lse: the block's own when None, else the one given)."""
    s = (q.to(accumulator(q.dtype)) @ k.to(accumulator(q.dtype)).transpose(-1, -2)) * _scale(q, scale)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if lse is None:
        lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)), lse
