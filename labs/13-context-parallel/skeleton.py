"""Lab 13: ring attention (Liu, Zaharia and Abbeel 2023), written by you: the online-softmax merge of two blocks,
and the ring that passes keys and values round the ranks, forward and backward.

Three functions are yours (marked "yours" below): `merge`, `ring_forward` and `ring_backward`. Given, above them:
`ring_of` (where this rank sits on the ring), `attend` and `attend_backward` (one block's attention and its
gradients: the fused kernel) and `ring_attention`, the autograd function made of your two rings. Read README.md
first (and lesson 10, sections 2 and 3), then grade your work with

    python -m toolkit grade labs/13-context-parallel                     # grades this file
    python -m toolkit grade labs/13-context-parallel --solution my.py    # or a copy of it

Rules of the game: talk only through `dist.isend` and `dist.irecv` (or `dist.batch_isend_irecv`), called as
`dist.something` so the grader can watch your messages, only with your two ring neighbours; attend blocks only
through the given `attend` and `attend_backward` (the grader notes when each runs, against your messages).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from toolkit.parallel.context import block as kernel

MASKS = ("all", "causal")


# --- given ---------------------------------------------------------------------------------------------------
def ring_of(group=None):
    """(my position r, ring size cp, global rank of the previous rank, global rank of the next rank)."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    me = ranks.index(dist.get_rank())
    n = len(ranks)
    return me, n, ranks[(me - 1) % n], ranks[(me + 1) % n]


def attend(q, k, v, mask: str):
    """(out, lse) of the queries q over one block of keys k and values v, each (batch, heads, tokens, head_dim)."""
    if mask not in MASKS:
        raise ValueError(
            f"attend(..., mask={mask!r}): the mask is 'all' (every key) or 'causal' (query i sees "
            "keys 0..i of the block: the diagonal block)"
        )
    return kernel.attend(q, k, v, causal=mask == "causal")


def attend_backward(grad_out, q, k, v, out, lse, mask: str):
    """(dq, dk, dv): this block's share of the gradients, given the gradient of the final output and the FINAL
    out and lse (over every key, not this block's own)."""
    if mask not in MASKS:
        raise ValueError(f"attend_backward(..., mask={mask!r}): the mask is 'all' or 'causal'")
    return kernel.attend_backward(grad_out, q, k, v, out, lse, causal=mask == "causal")


class RingAttention(torch.autograd.Function):
    """Ring attention as one differentiable operation: your forward ring, and your backward ring on its gradient."""

    @staticmethod
    def forward(ctx, q, k, v, causal, group):
        out, lse = ring_forward(q, k, v, causal, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.group = causal, group
        return out

    @staticmethod
    def backward(ctx, grad_out):
        dq, dk, dv = ring_backward(grad_out.contiguous(), *ctx.saved_tensors, ctx.causal, ctx.group)
        return dq, dk, dv, None, None


def ring_attention(q, k, v, causal: bool = True, group=None):
    """Attention of this rank's queries over the whole sequence; q, k, v of this rank's tokens (a contiguous split)."""
    return RingAttention.apply(q, k, v, causal, group)


# --- yours ---------------------------------------------------------------------------------------------------
def merge(out1, lse1, out2, lse2):
    """(out, lse) of the queries over the keys of both blocks, from (out1, lse1), their attention over the first
    block's keys alone, and (out2, lse2) over the second's.

    Shapes: out1, out2 (batch, heads, queries, head_dim); lse1, lse2 (batch, heads, queries), the log of each
    query's softmax normaliser over its block (lse = log sum_j e^(s_j)). Return the same shapes and dtype.
    The rule is lesson 10's (section 2); it must also hold where
    - the scores are large (an lse of 900: e^900 is inf even in float64, e^89 in float32), and
    - a block saw no key at all for some query: its lse is -inf and its output 0 (at least one of the two saw one).
    """
    raise NotImplementedError("merge: not written yet")


def ring_forward(q, k, v, causal: bool, group=None):
    """(out, lse) of this rank's queries over the keys and values of every rank of `group`, the blocks passed
    round the ring; q, k, v (batch, heads, tokens, head_dim) of this rank's tokens. The sequence is split
    contiguously: rank r of cp holds positions r·t .. (r+1)·t - 1 (t tokens each).

    cp steps. At each, this rank attends its queries to the block of keys and values it holds (`attend`, with the
    mask that block needs under `causal`, or not at all) and merges the result into what it has (`merge`); between
    two steps it sends the block it holds to the next rank and receives the previous rank's: cp - 1 passes, so
    that every block visits every rank. Whose block is in hand after s passes decides its mask (README, "The
    ring"). The pass that brings the next block is posted (dist.isend and dist.irecv) before this block's
    attention and waited for after it: the transfer hides behind the compute (README, "Overlap").
    Return out and lse in q's dtype.
    """
    raise NotImplementedError("ring_forward: not written yet")


def ring_backward(grad_out, q, k, v, out, lse, causal: bool, group=None):
    """(dq, dk, dv) of this rank's q, k and v, given grad_out (the gradient of this rank's rows of the output) and
    this rank's rows of the FINAL out and lse (over every key: what `ring_forward` returned).

    The keys and values go round the ring again, cp - 1 passes, each pass posted before the block's backward and
    waited for after it. `attend_backward` gives a block's share of dq (summed here) and of that block's dk and dv,
    which belong to the block's owner: the gradient of a block travels with it, each rank adding its share, and
    reaches its owner after the last step (README, "Backward"). Only the next and previous ranks talk.
    """
    raise NotImplementedError("ring_backward: not written yet")
