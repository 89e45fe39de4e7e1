"""FSDP's sharded checkpoint: each rank writes and reads its own slices, with no communication.

What a model too big for one rank needs: no rank ever holds more than its share. A shard loads back only
into the same layout (world size, sharding factor, units) and only on the rank that wrote it: every shard
has the same shapes, so a file copied from another rank would otherwise load silently and leave this rank
with the other's slices. The file records both, and loading checks both; to change the world size, go
through a full checkpoint (`checkpoint.save_full`).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .checkpoint_checks import SHARDED, agree, apply_groups, groups, inner, read


def _layout(model) -> dict:
    engine = model.engine
    return {
        "world_size": dist.get_world_size(),
        "sharding_group_size": engine.world,
        "units": [
            {"name": u.name, "params": list(u.param_names), "shapes": [list(s) for s in u.flat.shapes]}
            for u in engine.units
        ],
    }


def sharded_checkpoint(model, optimizer) -> dict:
    """This rank's slices and their optimizer state, as they are: no communication."""
    if not hasattr(model, "units"):
        raise ValueError("sharded checkpoints are FSDP's (wrap(model, 'fsdp')); use save_full for other strategies.")
    units = model.engine.units
    return {
        "format": SHARDED,
        **_layout(model),
        "rank": dist.get_rank(),
        "shard": model.engine.rank,
        "masters": [u.master.detach().cpu().clone() for u in units],
        "optimizer": {
            "type": type(inner(optimizer)).__name__,
            "param_groups": groups(optimizer),
            "state": [
                {
                    k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                    for k, v in inner(optimizer).state.get(u.master, {}).items()
                }
                for u in units
            ],
        },
    }


def _shard_path(directory: str, rank: int, world: int) -> str:
    return os.path.join(directory, f"shard-{rank:05d}-of-{world:05d}.pt")


def save_sharded(model, optimizer, directory: str) -> str:
    """Each rank writes its own file into `directory`; returns this rank's path."""
    checkpoint = sharded_checkpoint(model, optimizer)
    os.makedirs(directory, exist_ok=True)
    path = _shard_path(directory, dist.get_rank(), dist.get_world_size())
    torch.save(checkpoint, path)
    return path


@torch.no_grad()
def load_sharded(model, optimizer, directory: str) -> None:
    """Each rank reads its own file; the layout must be this model's exactly."""
    if not hasattr(model, "units"):
        raise ValueError("sharded checkpoints are FSDP's (wrap(model, 'fsdp')); use load_full for other strategies.")
    path = _shard_path(directory, dist.get_rank(), dist.get_world_size())
    checkpoint, error = read(path)
    if error and os.path.isdir(directory) and not os.path.exists(path):
        error += (
            f" The directory holds {sorted(os.listdir(directory))[:4]}: a sharded checkpoint loads only into "
            f"the world size it was saved from; use a full checkpoint to change it."
        )
    if error is None:
        error = _check_sharded(checkpoint, model, optimizer, path)
    agree(model, error)
    apply_groups(optimizer, checkpoint["optimizer"]["param_groups"])
    for unit, master, state in zip(model.engine.units, checkpoint["masters"], checkpoint["optimizer"]["state"]):
        unit.master.copy_(master)
        if state:
            inner(optimizer).state[unit.master] = {
                k: v.clone().to(unit.master.device) if torch.is_tensor(v) else v for k, v in state.items()
            }
        else:
            inner(optimizer).state.pop(unit.master, None)


def _check_sharded(checkpoint, model, optimizer, path: str) -> str | None:
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != SHARDED:
        return f"this is not an FSDP sharded checkpoint (expected format {SHARDED!r}); nothing was loaded."
    mine, rank = _layout(model), dist.get_rank()
    written = {"rank": checkpoint.get("rank"), "shard": checkpoint.get("shard", model.engine.rank)}
    if written != {"rank": rank, "shard": model.engine.rank}:
        return (
            f"the shard file {path!r} was written by rank {written['rank']} (slice {written['shard']} of its "
            f"sharding group), not rank {rank} (slice {model.engine.rank}): every rank's slices have the same "
            f"shapes, so a file copied or renamed from another rank would load silently with that rank's "
            f"weights. Put rank {rank}'s own file back (or load a full checkpoint); nothing was loaded."
        )
    for key in ("world_size", "sharding_group_size"):
        if checkpoint[key] != mine[key]:
            return (
                f"the sharded checkpoint was saved with {key}={checkpoint[key]}, this model has {mine[key]}: "
                f"sharded checkpoints load only into the same layout. Save a full checkpoint "
                f"(save_full) to change it; nothing was loaded."
            )
    if checkpoint["units"] != mine["units"]:
        return (
            "the sharded checkpoint's units (names, parameters, shapes) differ from this model's: another "
            "model or another wrap policy; nothing was loaded."
        )
    if checkpoint["optimizer"]["type"] != type(inner(optimizer)).__name__:
        return f"the checkpoint's optimizer state is {checkpoint['optimizer']['type']}'s; build the same optimizer."
    for unit, master in zip(model.engine.units, checkpoint["masters"]):
        if master.shape != unit.master.shape:
            return f"unit {unit.name!r}: saved slice of {tuple(master.shape)} vs {tuple(unit.master.shape)} here."
    return None
