"""Before ranks train together they must hold the same model: same shapes, and the same starting values.

A mismatch would otherwise surface as a hang (collectives of different sizes) or as silently wrong
training, so every data-parallel strategy checks shapes at wrap time and starts from rank 0's values.
"""

from __future__ import annotations

import hashlib

import torch

from .. import comm


def _signature(model: torch.nn.Module) -> int:
    text = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in model.named_parameters())
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def check_same_model(model: torch.nn.Module, group=None) -> None:
    """Raise on every rank if any rank's parameter names, shapes or dtypes differ from the others'."""
    ranks = comm.group_ranks(group)
    if len(ranks) == 1:
        return
    mine = torch.tensor([_signature(model)], dtype=torch.int64)
    everyone = torch.empty(len(ranks), dtype=torch.int64)
    comm.all_gather(everyone, mine, group=group)
    if len(set(everyone.tolist())) > 1:
        groups = {}
        for rank, sig in zip(ranks, everyone.tolist()):
            groups.setdefault(sig, []).append(rank)
        raise ValueError(
            "the ranks hold different models (parameter names, shapes or dtypes differ): ranks "
            + " vs ".join(str(g) for g in groups.values())
            + ". Build the same model on every rank (same config), then wrap it."
        )


@torch.no_grad()
def broadcast_from_rank0(tensors, group=None) -> None:
    """Overwrite every rank's tensors with the first rank of the group's values (DDP does this at start)."""
    src = comm.group_ranks(group)[0]
    for t in tensors:
        comm.broadcast(t.data, src=src, group=group)


def reject_experts(model: torch.nn.Module, strategy: str) -> None:
    """Sharded strategies treat every parameter as replicated; expert parameters are not (toolkit.moe)."""
    if any(getattr(p, "_toolkit_expert", False) for p in model.parameters()):
        raise ValueError(
            f"strategy {strategy!r} does not handle expert-parallel parameters (toolkit.moe "
            "experts differ per rank and must not be broadcast or sharded as if replicated). "
            "Train MoE models with 'ddp' or 'dp' for the dense parameters."
        )
