"""The online-softmax merge: two attentions of the same queries over different keys make the attention over both.

Attention of one query over keys K with values V is out = Σ_j p_j v_j with p_j = e^(s_j) / Σ_k e^(s_k), s = q·k/√d.
Split the keys in two blocks. Each block alone gives its own normalised output and the log of its own
normaliser, the log-sum-exp lse = log Σ_(k in block) e^(s_k) (what a fused attention kernel returns beside its
output, for backward). The normaliser of both blocks is the sum of theirs, so

    lse = log(e^lse1 + e^lse2)
    out = e^(lse1 - lse) · out1 + e^(lse2 - lse) · out2

(each block's output re-weighted by its share of the total normaliser). This is FlashAttention's online softmax
across the blocks of one device, and ring attention's across devices (Liu, Zaharia and Abbeel 2023): a rank
merges the block each step brings into what it has, in any order, and the result equals attention over the
whole sequence exactly (up to rounding). The exponents are never positive, so nothing overflows.

Shapes: out (batch, heads, queries, head_dim), lse (batch, heads, queries), both in fp32 while merging (fp64 for
fp64 inputs).
"""

from __future__ import annotations

import torch


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """(out, lse) of the queries over both key sets, from (out, lse) over the first and (block_out, block_lse)
    over the second."""
    total = torch.logaddexp(lse, block_lse)
    out = torch.exp(lse - total).unsqueeze(-1) * out + torch.exp(block_lse - total).unsqueeze(-1) * block_out
    return out, total


def merge_into(
    out: torch.Tensor, lse: torch.Tensor, rows: slice, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Merge a block that only the query rows `rows` attended (the later half, under zigzag) into (out, lse),
    in place; the other rows keep what they have."""
    out[:, :, rows], lse[:, :, rows] = merge(
        out[:, :, rows], lse[:, :, rows], block_out.to(out.dtype), block_lse.to(lse.dtype)
    )
