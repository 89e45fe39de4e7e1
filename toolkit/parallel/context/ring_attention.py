"""Ring attention (Liu, Zaharia and Abbeel 2023; Megatron-LM's and torch's context parallelism).

Each rank holds the queries, keys and values of its tokens (`sequence.py`). Attention needs every query against
every key, so the keys and values travel: in cp steps, each rank attends its queries to the block it holds
(`block.attend`), merges the result into what it has (`merge.py`), and meanwhile passes the block on to the next
rank (`ring.py`) and receives the previous rank's. No rank ever holds more than two blocks of keys and values,
and no rank holds the (s x s) scores, so activations per rank fall as 1/cp.

Backward is a ring too (a custom autograd Function, as the real systems write it, not autograd through the
sends): the keys and values go round again, each rank adds its queries' share of each block's gradients, and
the gradient of a block's keys and values travels with it, collecting every rank's share, until the last pass
brings it home to the rank that owns the block.

Which part of a block a rank must attend (`part`): without a causal mask, all of it. With one, a query sees
only keys at or before it, and the sequence split decides the work:

    contiguous  the block of an earlier rank: all of it; this rank's own: causal; a later rank's: nothing
                (the last rank attends cp blocks, the first one: the imbalance)
    zigzag      this rank holds chunks (i, 2cp-1-i), the block's owner j chunks (j, 2cp-1-j);
                own block (j = i): causal over the two chunks together;
                j < i: both query chunks see chunk j, neither sees chunk 2cp-1-j: all queries x first half of keys;
                j > i: chunk i sees nothing of it, chunk 2cp-1-i sees all of it: second half of queries x all keys.
                Every step but the first is half a block's work on every rank: balanced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...trace.events import recorder
from .block import accumulator, attend, attend_backward
from .merge import merge_into
from .ring import Ring
from .sequence import SequenceSplit

ALL = slice(None)


@dataclass(frozen=True)
class Part:
    """The rows of queries and of keys a step attends, and whether the step's mask is causal."""

    queries: slice
    keys: slice
    causal: bool


def part(me: int, owner: int, length: int, causal: bool, zigzag: bool) -> Part | None:
    """What rank `me` attends of the block of rank `owner` (each holds `length` tokens); None: nothing."""
    if not causal:
        return Part(ALL, ALL, False)
    if owner == me:
        return Part(ALL, ALL, True)
    if not zigzag:
        return Part(ALL, ALL, False) if owner < me else None
    half = length // 2
    return Part(ALL, slice(0, half), False) if owner < me else Part(slice(half, None), ALL, False)


def ring_attention(q, k, v, ring: Ring, split: SequenceSplit, causal: bool = True, scale: float | None = None):
    """Attention of this rank's queries over the whole sequence's keys and values; q, k, v (batch, heads,
    local tokens, head_dim) of this rank's tokens, in the order `split` gives them."""
    return RingAttention.apply(q, k, v, ring, split.zigzag, causal, scale)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, zigzag: bool, causal: bool, scale):
        length = q.shape[2]
        kv = torch.stack([k, v])  # one message per step: this rank's keys and values
        out = lse = None
        for step in range(ring.size):
            passing = ring.pass_on(kv) if step < ring.size - 1 else None  # the next block moves while we compute
            work = part(ring.rank, ring.source(step), length, causal, zigzag)
            if work is not None:
                with recorder.span("ring attention", step=step, owner=ring.source(step)):
                    block_out, block_lse = attend(
                        q[:, :, work.queries], kv[0][:, :, work.keys], kv[1][:, :, work.keys], work.causal, scale
                    )
                    if out is None:  # step 0: the own block, every query
                        out, lse = block_out.to(accumulator(q.dtype)), block_lse.to(accumulator(q.dtype))
                    else:
                        merge_into(out, lse, work.queries, block_out, block_lse)
            if passing is not None:
                kv = passing.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.zigzag, ctx.causal, ctx.scale = ring, zigzag, causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, length = ctx.ring, q.shape[2]
        grad_out = grad_out.contiguous()
        dq = torch.zeros_like(q, dtype=accumulator(q.dtype))
        kv = torch.stack([k, v])
        own = gradient = None  # the own block's share; the gradient travelling with a block
        for step in range(ring.size):
            passing = ring.pass_on(kv) if step < ring.size - 1 else None
            block = torch.zeros_like(kv, dtype=dq.dtype)  # this rank's share of the block's dk, dv
            work = part(ring.rank, ring.source(step), length, ctx.causal, ctx.zigzag)
            if work is not None:
                rows, keys = work.queries, work.keys
                with recorder.span("ring attention backward", step=step, owner=ring.source(step)):
                    dq_, dk_, dv_ = attend_backward(
                        grad_out[:, :, rows],
                        q[:, :, rows],
                        kv[0][:, :, keys],
                        kv[1][:, :, keys],
                        out[:, :, rows],
                        lse[:, :, rows],
                        work.causal,
                        ctx.scale,
                    )
                    dq[:, :, rows] += dq_
                    block[0][:, :, keys] += dk_
                    block[1][:, :, keys] += dv_
            if step == 0:
                own = block  # kept here until the block comes home
            else:
                if gradient is not None:  # what the ranks before added to this block
                    block += gradient.wait()
                gradient = ring.pass_on(block, "dkv")  # on to the next rank; the last pass reaches the owner
            if passing is not None:
                kv = passing.wait()
        if gradient is not None:
            own += gradient.wait()  # every other rank's share of this rank's own block
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None, None, None
