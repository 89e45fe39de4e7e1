"""Attention split by heads: the heads are independent, so each rank computes n_head/t of them.

The fused projection X -> [Q | K | V] is column-parallel, cut so that rank r gets the q, k and v columns
of the same heads r·a/t .. (r+1)·a/t - 1 (`shards.QKV_ROWS`: each of the three blocks cut t ways). The
rank then runs ordinary causal attention on its heads, with no talk, and the output projection is
row-parallel: its input features are exactly the concatenated outputs of this rank's heads. So attention
costs what the MLP costs: f before the projection (one all-reduce backward), g after (one forward).
Dropout of the attention weights draws from the tensor-parallel stream (`../rng.py`): each rank's heads get
masks of their own.

    X --f--> [Q_r | K_r | V_r] = X W_qkv,r --> softmax(Q_r K_r^T / sqrt(d)) V_r --> Y_r W_o,r --g--> + b_o
"""

from __future__ import annotations

import contextlib

import torch

from ...models.gpt import CausalSelfAttention
from ..rng import tracker
from .linear import ColumnParallelLinear, RowParallelLinear
from .operators import TPGroup
from .shards import qkv_rows


class TensorParallelAttention(CausalSelfAttention):
    """The toolkit GPT's attention with this rank's heads only (n_head/t of them, and n_kv_head/t key-value heads)."""

    local_heads: int
    local_kv_heads: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, T, local q, k and v widths); T whole also under sequence parallelism
        q, k, v = self.heads(qkv, self.local_heads, self.local_kv_heads)
        # the GPT's causal attention (context parallelism replaces it); this rank's heads: dropout masks of their own
        with tracker.fork() if self.dropout_p() else contextlib.nullcontext():
            y = self.attend(q, k, v)
        B, heads, T, head_dim = y.shape
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, heads * head_dim)))


def split_attention(attn: CausalSelfAttention, tp: TPGroup, done: dict, name: str, sequence_parallel: bool):
    """Make the GPT's attention tensor-parallel, in place (the class changes, the names stay)."""
    for field, heads, kind in (("n_head", attn.n_head, "heads"), ("n_kv_head", attn.n_kv_head, "key-value heads")):
        if heads % tp.size:  # (a rank keeps the key-value heads its query heads share: both must split)
            fits = [t for t in range(1, heads + 1) if heads % t == 0]
            raise ValueError(
                f"tensor parallelism splits attention by heads: {field}={heads} of {name!r} does not "
                f"split over tp={tp.size} ranks. Choose a tp that divides it (one of {fits}), or a model "
                f"with a multiple of {tp.size} {kind}."
            )
    split = qkv_rows(attn.n_head, attn.n_kv_head)
    attn.qkv = ColumnParallelLinear(
        attn.qkv, tp, done, f"{name}.qkv", weight_split=split, sequence_parallel=sequence_parallel
    )
    attn.proj = RowParallelLinear(attn.proj, tp, done, f"{name}.proj", sequence_parallel=sequence_parallel)
    attn.__class__ = TensorParallelAttention
    attn.local_heads, attn.local_kv_heads = attn.n_head // tp.size, attn.n_kv_head // tp.size
    return attn
