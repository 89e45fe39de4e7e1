"""Gradient clipping under tensor parallelism: the global norm, every gradient element counted once.

The norm a single process would compute is over the full gradient. In a dp x tp layout the pieces lie
around the world, some of them in several copies:

    a split parameter       one piece per tensor-parallel rank, different on each: count every piece
    a replicated parameter  the same whole gradient on every tensor-parallel rank: count it on tp rank 0
                            only (Megatron's `param_is_not_tensor_parallel_duplicate`)
    across dp               replicated strategies (local, dp, ddp) hold the same averaged gradient on every
                            dp rank: count it on dp rank 0; sharded ones (zero1-3, fsdp) hold disjoint
                            slices: count each slice where it lies (with hybrid sharding, in replica 0)
    MoE experts             each rank holds its own experts: count them all (where ep < dp x cp x tp, and
                            experts have copies, `parallel/expert_layout.py`: on copy 0 only)

Each rank adds the squares it counts, one all-reduce over the world adds the ranks' sums, and every rank
scales what it holds by the same min(1, max_norm / (norm + 1e-6)), as torch.nn.utils.clip_grad_norm_.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ... import comm
from ...moe.experts import is_expert
from .state import TensorParallel


def _sharded_squares(engine, counted) -> tuple[torch.Tensor, list]:
    replicas = getattr(getattr(engine, "sharding", None), "replica_group", None)
    first_replica = replicas is None or comm.group_ranks(replicas).index(dist.get_rank()) == 0
    total, grads = None, []
    for piece in engine.pieces:
        g = piece.mine.grad
        if g is None:
            continue
        grads.append(g)
        total = g.new_zeros((), dtype=torch.float32) if total is None else total
        if not first_replica:
            continue
        for part in piece.flat.pieces(engine.rank):
            if counted(engine.names[piece.params[part.index]]):
                total = total + g[part.shard_start : part.shard_end].float().pow(2).sum()
    return total, grads


def _replicated_squares(module, counted, first_dp: bool) -> tuple[torch.Tensor, list]:
    total, grads = None, []
    for name, p in module.named_parameters():
        if p.grad is None:
            continue
        grads.append(p.grad)
        total = p.grad.new_zeros((), dtype=torch.float32) if total is None else total
        if (is_expert(p) and not getattr(p, "_toolkit_expert_copy", 0)) or (first_dp and counted(name)):
            total = total + p.grad.float().pow(2).sum()
    return total, grads


@torch.no_grad()
def clip_grad_norm_(model, info: TensorParallel, dp_rank: int, max_norm: float, norm_type: float = 2.0):
    """Clip the gradients `model` (a wrapped, tensor-parallel model) holds to a global L2 norm of `max_norm`."""
    if norm_type != 2:
        raise ValueError(f"norm_type={norm_type!r}: clipping under tensor parallelism supports the L2 norm (2.0).")
    counted = lambda name: info.is_split(name) or info.tp.rank == 0  # noqa: E731

    def clip(limit: float) -> torch.Tensor:
        engine = getattr(model, "engine", None)
        if engine is not None and hasattr(engine, "pieces"):
            total, grads = _sharded_squares(engine, counted)
        else:
            total, grads = _replicated_squares(model.module, counted, dp_rank == 0)
        if total is None:  # no gradient here: this rank still adds its zero to the others'
            from ...runtime import env

            total = torch.zeros((), dtype=torch.float32, device=env.device())
        total = total.reshape(1).clone()
        comm.all_reduce(total)  # over the world: every piece counted once, wherever it lies
        norm = total[0].sqrt()
        coef = (limit / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return norm

    scaler = getattr(model, "scaler", None)
    return clip(max_norm) if scaler is None else scaler.clip_norm(clip, max_norm)
