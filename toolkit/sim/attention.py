"""Attention on the simulated cluster as a real rank runs it: the fused kernel, not the math path.

On a real device `F.scaled_dot_product_attention` picks a fused kernel (FlashAttention on a GPU, its
CPU port on this machine) that keeps only the output and a log-sum-exp for backward. On meta tensors
torch has no kernel to pick and falls back to the math path, which builds the (heads, s, s) scores
and their softmax and keeps them for backward: at GPT-3's 2048 tokens that is several times the
activations a real rank keeps, and a "does it fit?" answer far too pessimistic.

`fused_attention()` sends such calls on meta tensors to the fused kernel's own op, which has meta
shapes and an autograd formula; calls it cannot take (an explicit mask) stay as they were. Grouped-query
attention (`enable_gqa=True`, K and V with fewer heads than Q, as transformers' Llama 3 and Mistral call it)
takes the fused op too, K and V as they are: FlashAttention-2 and torch's CUDA kernels take them so, and its
FLOPs are counted per query head.
`FLOPS` teaches the op counter (`record.py`) that op's FLOPs: torch's flop registry counts the GPU flash
kernels, not the CPU one, and the count is the same formula.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten
_FUSED = aten._scaled_dot_product_flash_attention_for_cpu


def _forward_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


FLOPS = {_FUSED: _forward_flops, aten._scaled_dot_product_flash_attention_for_cpu_backward: _backward_flops}


def _fused_on_meta(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
    """scaled_dot_product_attention, taking the fused kernel's op for meta tensors it can handle."""
    gqa = kwargs.pop("enable_gqa", False)
    if query.is_meta and attn_mask is None and (gqa or key.shape[-3] == query.shape[-3]):
        out, _ = _FUSED(query, key, value, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
        return out
    return _ORIGINAL(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=gqa, **kwargs)


_ORIGINAL = F.scaled_dot_product_attention


@contextlib.contextmanager
def fused_attention():
    """Inside: F.scaled_dot_product_attention on meta tensors takes the fused kernel's op.

    The function itself is swapped for the block (and put back after, even on error), not intercepted by
    a TorchFunctionMode: autograd runs backward without the caller's function modes, and activation
    checkpointing recomputes the forward there, which must take the same path as the forward did.
    """
    F.scaled_dot_product_attention = _fused_on_meta
    try:
        yield
    finally:
        F.scaled_dot_product_attention = _ORIGINAL
