"""DeepSpeed-Ulysses (Jacobs et al. 2023): trade the sequence split for a head split around attention.

Everything in a transformer layer but attention is independent per token, so it runs on this rank's s/cp tokens.
Attention is independent per *head*: so before it, one all-to-all turns "all heads of my s/cp tokens" into
"a/cp of the heads for all s tokens", ordinary attention runs on whole sequences (any mask, any kernel), and
one all-to-all after it turns the output back:

    q, k, v  (b, a, s/cp, d)  --all-to-all-->  (b, a/cp, s, d)  --attention-->  (b, a/cp, s, d)
    output   (b, a/cp, s, d)  --all-to-all-->  (b, a, s/cp, d)

Backward is the same two all-to-alls in reverse. Compared with the ring:

- its limit: the heads must divide among the cp ranks (a % cp == 0; under tensor parallelism, the a/t heads of a
  tensor-parallel rank), so cp cannot exceed the number of heads;
- its bytes: each rank sends (cp-1)/cp of its q, k, v and of the output (4 tensors of b·a·(s/cp)·d) per layer
  forward, a volume per link that stays the same when s and cp grow together; the ring sends (cp-1) blocks of k
  and v (2 tensors) that it can hide behind compute, which the all-to-alls, on the critical path, cannot;
- grouped-query attention (n_kv_head < n_head): k and v cross in a message of their own, with their compact
  heads, so those too must divide among the cp ranks (Llama 3, with 8 key-value heads, all-gathers K and V
  instead; the toolkit's ring passes them compact and has no such limit);
- no load balancing is needed: every rank attends whole sequences, so a contiguous split is balanced;
- one more activation per layer: the attention kernel keeps its output in the head split for its backward, and
  the projection after it keeps the same values in the sequence split (s·b·h/cp each); the ring's output is
  both at once.
"""

from __future__ import annotations

import torch

from ... import comm
from ...models.gpt import repeat_kv
from .operators import CPGroup, labelled


def check_heads(heads: int, cp: int, where: str = "the model", kv_heads: int | None = None) -> None:
    """Ulysses splits the heads over the cp ranks: say so, before anything runs, when they do not split
    (the key-value heads too, under grouped-query attention)."""
    if heads % cp:
        fits = [c for c in range(1, heads + 1) if heads % c == 0]
        raise ValueError(
            f"Ulysses (cp_attention='ulysses') gives each of the cp={cp} ranks heads/cp of the attention "
            f"heads for the whole sequence: {where} has {heads} heads per rank, which do not split over "
            f"{cp} ranks. Choose cp among {fits}, or cp_attention='ring' (no limit on heads)."
        )
    if kv_heads is not None and kv_heads % cp:
        fits = [c for c in range(1, kv_heads + 1) if kv_heads % c == 0]
        raise ValueError(
            f"Ulysses (cp_attention='ulysses') cannot split grouped-query attention's keys and values over "
            f"cp={cp} ranks: {where} has n_kv_head={kv_heads} key-value heads per rank, which do not split "
            f"over {cp} ranks (Llama 3 all-gathers K and V for this reason). Choose cp among {fits}, or "
            f"cp_attention='ring', which passes the compact K and V around and has no limit on heads."
        )


def _all_to_all(x: torch.Tensor, cp: CPGroup, scatter: int, gather: int) -> torch.Tensor:
    """Split x's dimension `scatter` into cp parts, send part j to rank j, and join what every rank sent along
    dimension `gather` (in rank order)."""
    parts = torch.stack(x.chunk(cp.size, dim=scatter)).contiguous()  # (cp, ...): row j goes to rank j
    received = torch.empty_like(parts)
    labelled([lambda: comm.all_to_all(received, parts, group=cp.group)], "ulysses")
    return torch.cat(received.unbind(0), dim=gather)


class _SequenceToHeads(torch.autograd.Function):
    """(…, a, s/cp, d) -> (…, a/cp, s, d) forward; the reverse all-to-all backward."""

    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp = cp
        return _all_to_all(x, cp, scatter=-3, gather=-2)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.cp, scatter=-2, gather=-3), None


class _HeadsToSequence(torch.autograd.Function):
    """(…, a/cp, s, d) -> (…, a, s/cp, d) forward; the reverse all-to-all backward."""

    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp = cp
        return _all_to_all(x, cp, scatter=-2, gather=-3)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.cp, scatter=-3, gather=-2), None


def ulysses_attention(q, k, v, cp: CPGroup, causal: bool = True, scale: float | None = None):
    """Attention of this rank's tokens (q, k, v of shape (batch, heads, s/cp, head_dim), a contiguous split) over
    the whole sequence, by Ulysses' two all-to-alls; q, k and v cross in one message (k and v in one of their
    own when they have fewer heads: grouped-query attention, repeated for their groups after the all-to-all)."""
    check_heads(q.shape[1], cp.size, kv_heads=k.shape[1])
    if k.shape[1] == q.shape[1]:
        q, k, v = _SequenceToHeads.apply(torch.stack([q, k, v]), cp)  # (3, b, a/cp, s, d)
    else:
        q, (k, v) = _SequenceToHeads.apply(q, cp), _SequenceToHeads.apply(torch.stack([k, v]), cp)
        k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    return _HeadsToSequence.apply(y, cp)
