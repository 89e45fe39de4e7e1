"""The toolkit's GPT with the kernels a paper's own code ran, so the simulator prices what was measured.

The toolkit's GPT calls one fused attention (`F.scaled_dot_product_attention`, FlashAttention on a GPU)
and has no dropout. The papers the simulator is held against ran older code, whose attention builds the
(heads, s, s) scores in memory and walks over them several times: at s = 2,048 that traffic costs more
than the attention's GEMMs. Each style below rewrites the attention (and, for minGPT, the MLP's GELU
and the residual dropouts) with the operations that code ran, one aten call per kernel it launched:

- "megatron": Megatron-LM as in Narayanan et al., SC21 (`megatron/model/transformer.py`,
  `fused_softmax.py`): the scaled scores in one `baddbmm`, one fused upper-triangular masked
  softmax kernel (here `softmax`: the same one read and one write), attention dropout (p = 0.1, its mask
  written), the `bmm` with the values. Its other fusions (bias + GELU, bias + dropout + residual add)
  cost what the toolkit's GEMM-with-bias, GELU and add cost, so they stay as they are.
- "mingpt": minGPT (Karpathy), which the FSDP paper's GPT-175B is: scores by matmul, then a separate
  scale, `masked_fill`, softmax and attention dropout, the `bmm` with the values; GELU written out
  (`NewGELU`, seven elementwise kernels); dropout after each residual branch.

`under_autocast(model)` runs the model as `torch.autocast` runs it on a GPU: fp32 parameters, each Linear in 16 bits
(its input and weight cast first), everything else in the dtype its inputs promote to (the residual stream and
LayerNorm in fp32), the loss over fp32 logits. Autocast itself does not reach the meta tensors the simulator runs on.

`recompute_blocks(model)` runs every block under activation checkpointing, the papers' full
recomputation (the whole block again in backward, as Megatron's reentrant checkpoint does; torch's
non-reentrant one would stop after the last saved activation, skipping the block's last GEMM), for
strategies that have no such option of their own.

    model = as_in(tiny_gpt(...), "megatron")
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from .gpt import MLP, Block, CausalSelfAttention, repeat_kv

DROPOUT = 0.1  # both papers' attention and hidden dropout
STYLES = ("megatron", "mingpt")


def _dropout(x: torch.Tensor, training: bool) -> torch.Tensor:
    """Dropout as a GPU runs it: one fused kernel (`native_dropout`; torch takes it on CUDA tensors, while on
    CPU and meta tensors `F.dropout` runs three: a Bernoulli mask, its scaling, the product)."""
    return torch.native_dropout(x, DROPOUT, True)[0] if training else x


def _heads(attn: CausalSelfAttention, x: torch.Tensor, head_dim: int):
    """q, k, v as (batch x heads, tokens, head_dim), for however many heads this rank's qkv holds."""
    if attn.n_kv_head != attn.n_head:
        raise ValueError(
            f"as_in_papers: the papers' attention has as many key-value heads as query heads; this model has "
            f"n_kv_head={attn.n_kv_head} for n_head={attn.n_head} (grouped-query attention): leave n_kv_head unset."
        )
    B, T, _ = x.shape
    qkv = attn.qkv(x)
    local = qkv.shape[-1] // 3
    heads = local // head_dim
    q, k, v = (
        t.reshape(B, T, heads, head_dim).transpose(1, 2).reshape(B * heads, T, head_dim)
        for t in qkv.split(local, dim=-1)
    )
    return q, k, v, heads


def _merge(attn, y: torch.Tensor, B: int, T: int, heads: int, head_dim: int) -> torch.Tensor:
    return attn.proj(y.reshape(B, heads, T, head_dim).transpose(1, 2).reshape(B, T, heads * head_dim))


def _megatron_attend(attn):
    """Megatron-LM's core attention as the GPT's `attend(q, k, v)` on (batch, heads, tokens, head_dim) tensors, so
    that whatever wraps the core (tensor parallelism's heads and dropout stream, Megatron's selective recomputation:
    `activation_checkpointing="attention"`) wraps this one."""

    def attend(q, k, v):
        B, heads, T, head_dim = q.shape
        k, v = repeat_kv(k, heads), repeat_kv(v, heads)
        q, k, v = (t.reshape(B * heads, T, head_dim) for t in (q, k, v))
        empty = torch.empty(B * heads, T, T, dtype=q.dtype, device=q.device)
        scores = torch.baddbmm(empty, q, k.transpose(1, 2), beta=0.0, alpha=1.0 / math.sqrt(head_dim))
        probs = _dropout(torch.softmax(scores, dim=-1), attn.training)  # causal mask made inside the kernel
        return torch.bmm(probs, v).view(B, heads, T, head_dim)

    return attend


def _mingpt_attention(attn, head_dim):
    def forward(x):
        B, T, _ = x.shape
        q, k, v, heads = _heads(attn, x, head_dim)
        scores = torch.bmm(q, k.transpose(1, 2)) * (1.0 / math.sqrt(head_dim))
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = _dropout(torch.softmax(scores, dim=-1), attn.training)
        return _dropout(_merge(attn, torch.bmm(probs, v), B, T, heads, head_dim), attn.training)

    return forward


def _new_gelu(x: torch.Tensor) -> torch.Tensor:
    """minGPT's GELU, the tanh approximation written out (one kernel per operation)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _mingpt_mlp(mlp: MLP):
    def forward(x):
        return _dropout(mlp.proj(_new_gelu(mlp.fc(x))), mlp.training)

    return forward


def as_in(model: torch.nn.Module, style: str) -> torch.nn.Module:
    """`model` (a toolkit GPT) with its attention (and for "mingpt" its MLPs) running `style`'s kernels; in place."""
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; choose one of {STYLES}.")
    head_dim = model.config.d_model // model.config.n_head
    for module in model.modules():
        if isinstance(module, CausalSelfAttention) and style == "megatron":
            module.attend = _megatron_attend(module)
            module.attention_dropout = DROPOUT  # under tensor parallelism: its heads' masks from their stream
        elif isinstance(module, CausalSelfAttention):
            module.forward = _mingpt_attention(module, head_dim)
        elif isinstance(module, MLP) and style == "mingpt":
            module.forward = _mingpt_mlp(module)
    return model


def _autocast_linear(linear: torch.nn.Linear, dtype: torch.dtype, upcast: bool):
    def forward(x):
        bias = None if linear.bias is None else linear.bias.to(dtype)
        out = F.linear(x.to(dtype), linear.weight.to(dtype), bias)
        return out.float() if upcast else out

    return forward


def under_autocast(model: torch.nn.Module, dtype: torch.dtype = torch.float16) -> torch.nn.Module:
    """`model` (a toolkit GPT, parameters in fp32) as `torch.autocast(dtype=dtype)` runs it, on any device; in place.

    Autocast casts a GEMM's inputs to 16 bits (each weight once a forward, its gradient cast back to fp32 in
    backward, where the fp32 `.grad` gathers it) and leaves other operations to type promotion: the embeddings,
    LayerNorm and the residual stream stay fp32 (a 16-bit branch added to it is promoted). `cross_entropy` is on its
    fp32 list, so the head's logits come out in fp32 here."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"under_autocast: dtype={dtype} is not one autocast computes in; use torch.float16 or torch.bfloat16"
        )
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = _autocast_linear(module, dtype, upcast=name == "head")
    return model


def recompute_blocks(model: torch.nn.Module) -> torch.nn.Module:
    """Every transformer block of `model` under activation checkpointing (its activations recomputed in
    backward, the whole block, only its input kept); in place."""

    def checkpointed(forward):
        def run(*args, **kwargs):
            with torch.utils.checkpoint.set_checkpoint_early_stop(False):
                return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

        return run

    for block in model.modules():
        if isinstance(block, Block):
            block.forward = checkpointed(block.forward)
    return model
