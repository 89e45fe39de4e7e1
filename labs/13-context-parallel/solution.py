"""Lab 13: ring attention's merge and pass (Liu, Zaharia and Abbeel 2023). The reference solution.

Self-contained on purpose (the lab stands alone): `toolkit/parallel/context/` is the same algorithm as the toolkit
uses it, with the zigzag split and the trace's labels.
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
    """(out, lse) over both blocks' keys from (out1, lse1) over the first and (out2, lse2) over the second."""
    top = torch.maximum(lse1, lse2)  # the larger normaliser: every exponent below is <= 0
    w1, w2 = torch.exp(lse1 - top), torch.exp(lse2 - top)
    total = w1 + w2
    out = (w1 / total).unsqueeze(-1) * out1 + (w2 / total).unsqueeze(-1) * out2
    return out, top + torch.log(total)


def block_mask(me: int, owner: int, causal: bool):
    """What rank `me`'s queries attend of rank `owner`'s keys: "all", "causal" (the diagonal block) or None."""
    if not causal or owner < me:
        return "all"
    return "causal" if owner == me else None


def source(me: int, step: int, n: int) -> int:
    """Whose block rank `me` holds after `step` passes: each pass brings the previous rank's."""
    return (me - step) % n


def pass_on(block, previous: int, following: int, group):
    """Post the send of `block` to the next rank and the receive of the previous rank's: (its buffer, the works)."""
    incoming = torch.empty_like(block)
    return incoming, [dist.isend(block, following, group), dist.irecv(incoming, previous, group)]


def wait(works) -> None:
    for work in works:
        work.wait()


def ring_forward(q, k, v, causal: bool, group=None):
    """(out, lse) of this rank's queries over every rank's keys and values, the blocks passed round the ring."""
    me, n, previous, following = ring_of(group)
    kv = torch.stack([k, v])
    out = lse = None
    for step in range(n):
        if step < n - 1:  # the next block travels while this one is attended
            incoming, works = pass_on(kv, previous, following, group)
        mask = block_mask(me, source(me, step, n), causal)
        if mask is not None:
            block_out, block_lse = attend(q, kv[0], kv[1], mask)
            out, lse = (block_out, block_lse) if out is None else merge(out, lse, block_out, block_lse)
        if step < n - 1:
            wait(works)
            kv = incoming
    return out, lse


def ring_backward(grad_out, q, k, v, out, lse, causal: bool, group=None):
    """(dq, dk, dv) of this rank's q, k, v: the blocks go round again, each block's gradient travelling with it."""
    me, n, previous, following = ring_of(group)
    kv = torch.stack([k, v])
    dq = torch.zeros_like(q)
    home = travelling = None  # this rank's share of its own block; the gradient passing by
    for step in range(n):
        if step < n - 1:
            incoming, works = pass_on(kv, previous, following, group)
        mask = block_mask(me, source(me, step, n), causal)
        if mask is None:  # nothing of this block seen: no share of its gradient
            share = torch.zeros_like(kv)
        else:
            dq_block, dk_block, dv_block = attend_backward(grad_out, q, kv[0], kv[1], out, lse, mask)
            dq += dq_block
            share = torch.stack([dk_block, dv_block])
        if step == 0:
            home = share
        else:
            if travelling is not None:  # what the ranks before added to this block
                wait(travelling[1])
                share += travelling[0]
            travelling = pass_on(share, previous, following, group)
        if step < n - 1:
            wait(works)
            kv = incoming
    if travelling is not None:  # every other rank's share of this rank's own block
        wait(travelling[1])
        home += travelling[0]
    return dq, home[0], home[1]
