"""Clipping by the global norm when every rank holds only slices of the averaged gradient (ZeRO, FSDP).

The norm of the whole gradient is one all-reduce away: each rank's slices are disjoint, so their sums of
squares add up (and their maxima give the inf-norm). Every rank then scales its own slices by the same
factor, as `torch.nn.utils.clip_grad_norm_` would scale the whole gradient.
"""

from __future__ import annotations

import math

import torch

from .. import comm
from ..runtime import env


def global_grad_norm(shards, norm_type: float, group=None) -> torch.Tensor:
    """The norm of the whole averaged gradient, from slices held on different ranks.

    Each rank holds a disjoint slice, so the squares add up: norm = sqrt(all_reduce(sum of squares)).
    (One shard's norm alone would be too small by about sqrt(N).) The inf-norm takes a max instead.
    Padding contributes nothing: its gradient is zero.
    """
    grads = [s.grad.detach().float() for s in shards if s.grad is not None]
    device = shards[0].master.device if shards else env.device()
    if norm_type == math.inf:
        total = torch.stack([g.abs().max() for g in grads]).max().reshape(1) if grads else torch.zeros(1, device=device)
        comm.all_reduce(total, op="max", group=group)
        return total[0]
    total = sum((g.pow(2).sum() for g in grads), torch.zeros((), device=device)).reshape(1)
    comm.all_reduce(total, op="sum", group=group)
    return total[0].sqrt()


@torch.no_grad()
def clip_grad_norm_(shards, max_norm: float, norm_type: float = 2.0, group=None) -> torch.Tensor:
    """Scale every rank's gradient slices so the *global* norm is at most `max_norm`; return that norm.

    Same rule as `torch.nn.utils.clip_grad_norm_`: multiply by min(1, max_norm / (norm + 1e-6)).
    """
    if norm_type not in (2, math.inf):
        raise ValueError(f"norm_type={norm_type!r}: sharded clipping supports 2.0 and math.inf.")
    total = global_grad_norm(shards, float(norm_type), group)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for s in shards:
        if s.grad is not None:
            s.grad.mul_(coef.to(s.grad.dtype))
    return total
