"""Checkpoints: a full one that every strategy can write and read, and FSDP's sharded one.

Two ways to save a sharded model, as in torch FSDP:

* **Full** (`save_full` / `load_full`): every parameter whole, under its original name, with the
  optimizer's state whole too (Adam's two moments per parameter, its step count), in fp32. Gathering
  it costs an all-gather of the shards, and rank 0 alone writes the file. It does not remember how it
  was sharded, so it loads into any strategy at any world size: FSDP on 2 ranks -> "local" -> ZeRO-2
  on 4 ranks -> FSDP on 3 ranks, all holding the same parameters and optimizer state.
* **Sharded** (`save_sharded` / `load_sharded`, FSDP only, `checkpoint_sharded.py`): each rank writes
  its own slices, no communication, no rank holding more than its share: what a model too big for one
  rank needs. It loads back only into the same layout (world size, sharding factor, units), on the rank
  that wrote it; to change the world size, go through a full checkpoint.

Loading (`checkpoint_checks.py`) checks everything first (format, names, shapes, the optimizer's kind and its state's
shapes) and writes nothing unless all of it fits; ranks agree before anyone writes, so a bad file raises on
every rank rather than leaving some loaded and others not. Files are read with
`torch.load(weights_only=True)`: plain tensors, numbers and strings, no arbitrary code.

The full format (portable, keyed by name; a tied weight appears once, under its first name):

    {"format": "toolkit.full/1",
     "model": {name: tensor},
     "optimizer": {"type": "AdamW", "param_groups": [{"lr": ..., ...}], "state": {name: {"step": ..., "exp_avg": ...}}}}
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .. import comm
from ..runtime import env
from ..trace.events import phase
from .checkpoint_checks import (
    FULL,
    AnotherRankCouldNotLoad,
    agree,
    apply_groups,
    check_full,
    check_slices,
    distributed,
    groups,
    inner,
    is_sharded,
    read,
    replicated,
)
from .checkpoint_sharded import load_sharded, save_sharded, sharded_checkpoint
from .flat import FlatBuffer

__all__ = [
    "AnotherRankCouldNotLoad",
    "full_checkpoint",
    "load_full",
    "load_full_checkpoint",
    "load_sharded",
    "save_full",
    "save_sharded",
    "sharded_checkpoint",
]
_read = read  # the name tests and older callers use


# --- full checkpoints ---------------------------------------------------------------------------------------
@torch.no_grad()
def full_checkpoint(model, optimizer, *, rank0_only: bool = True) -> dict | None:
    """The whole model and optimizer state in the portable format, on CPU. Every rank must call it
    (a sharded model all-gathers); with rank0_only, ranks other than 0 get None."""
    params, state = {}, {}
    if is_sharded(model):
        engine = model.engine
        with phase("checkpoint"):
            for piece in engine.pieces:
                full = _gather(piece.mine.master, piece.flat.shapes, engine)
                params.update({engine.names[p]: v for p, v in zip(piece.params, full)})
                per_param = [{} for _ in piece.params]
                for key, value in sorted(inner(optimizer).state.get(piece.mine.master, {}).items()):
                    if torch.is_tensor(value) and value.shape == piece.mine.master.shape:
                        parts = _gather(value, piece.flat.shapes, engine)
                    else:  # a scalar (Adam's step): the same for every parameter of the slice
                        parts = [value.clone() if torch.is_tensor(value) else value] * len(piece.params)
                    for entry, part in zip(per_param, parts):
                        entry[key] = part
                state.update({engine.names[p]: s for p, s in zip(piece.params, per_param) if s})
        params.update({engine.names[p]: p.detach().float().clone() for p in engine.frozen})
    else:
        names, stepped, _ = replicated(model)
        for name, t in zip(names, stepped):
            params[name] = t.detach().float().clone()
            if t in optimizer.state:
                state[name] = {
                    k: v.detach().clone() if torch.is_tensor(v) else v for k, v in optimizer.state[t].items()
                }
    if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
        return None
    cpu = {n: t.cpu() for n, t in params.items()}
    state = {n: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()} for n, s in state.items()}
    return {
        "format": FULL,
        "model": cpu,
        "optimizer": {"type": type(inner(optimizer)).__name__, "param_groups": groups(optimizer), "state": state},
    }


def _gather(shard: torch.Tensor, shapes, engine) -> list[torch.Tensor]:
    full = FlatBuffer(shapes, engine.world, dtype=torch.float32, device=shard.device)
    comm.all_gather(full.data, shard.detach().float(), group=engine.group)
    return [v.clone() for v in full.views()]


def save_full(model, optimizer, path: str) -> None:
    """Gather the full checkpoint and write it from rank 0 (every rank must call this)."""
    if hasattr(model, "save_full"):  # a model laid out in parts saves itself (pp > 1: pipeline/checkpoint.py)
        return model.save_full(optimizer, path)
    if getattr(model, "tensor_parallel", None) is not None:  # tensor-parallel pieces joined (tensor/checkpoint.py)
        from .tensor import checkpoint as tensor_parallel

        checkpoint = tensor_parallel.join(model, full_checkpoint(model, optimizer, rank0_only=False))
    else:
        checkpoint = full_checkpoint(model, optimizer, rank0_only=True)
    if checkpoint is not None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        torch.save(checkpoint, path)
    if dist.is_initialized() and distributed(model):
        comm.barrier()  # nobody reads the file before it is complete


def load_full(model, optimizer, path: str) -> None:
    """Read a full checkpoint (every rank reads the file: it must be visible to all) and load it."""
    if hasattr(model, "load_full"):  # a model laid out in parts loads itself (pp > 1: each stage its own part)
        return model.load_full(optimizer, path)
    checkpoint, error = read(path)
    if getattr(model, "tensor_parallel", None) is not None:  # this rank's tensor-parallel pieces of it
        from .tensor import checkpoint as tensor_parallel

        checkpoint = tensor_parallel.cut(model, checkpoint)
    load_full_checkpoint(model, optimizer, checkpoint, _error=error)


@torch.no_grad()
def load_full_checkpoint(model, optimizer, checkpoint: dict, *, _error: str | None = None) -> None:
    """Load the portable format into `model` and `optimizer`, whatever the strategy and world size."""
    if is_sharded(model):
        engine = model.engine
        shapes = engine.shapes()
    else:
        names, stepped, _ = replicated(model)
        shapes = dict(zip(names, (t.shape for t in stepped)))
    error = _error or check_full(checkpoint, shapes, optimizer)
    if error is None and is_sharded(model):
        error = check_slices(checkpoint, engine)
    agree(model, error)
    apply_groups(optimizer, checkpoint["optimizer"]["param_groups"])
    state = checkpoint["optimizer"]["state"]
    device = env.device() if distributed(model) else None
    if is_sharded(model):
        for piece in engine.pieces:
            piece_names = [engine.names[p] for p in piece.params]
            piece.mine.master.copy_(_slice([checkpoint["model"][n] for n in piece_names], piece, engine))
            entries = [state.get(n, {}) for n in piece_names]
            if not entries[0]:
                inner(optimizer).state.pop(piece.mine.master, None)
                continue
            loaded = {}
            for key, value in entries[0].items():
                if torch.is_tensor(value) and value.dim() > 0:
                    loaded[key] = _slice([e[key] for e in entries], piece, engine)
                else:
                    loaded[key] = value.clone().to(piece.mine.master.device) if torch.is_tensor(value) else value
            inner(optimizer).state[piece.mine.master] = loaded
        for p in engine.frozen:
            p.copy_(checkpoint["model"][engine.names[p]])
        engine.after_step()  # each strategy's own "masters -> model" (ZeRO-1/2 all-gather them)
    else:
        names, stepped, module_params = replicated(model)
        for name, t, p in zip(names, stepped, module_params):
            t.copy_(checkpoint["model"][name])
            if p is not t:
                p.copy_(t)  # mixed precision: the 16-bit parameter is the rounded master
            if name in state:
                optimizer.state[t] = {
                    k: v.clone().to(device or t.device) if torch.is_tensor(v) else v for k, v in state[name].items()
                }
            else:
                optimizer.state.pop(t, None)


def _slice(tensors, piece, engine) -> torch.Tensor:
    full = FlatBuffer(piece.flat.shapes, engine.world, dtype=torch.float32, device=piece.mine.master.device)
    full.copy_from([t.to(full.data.device) for t in tensors])
    return full.shard(engine.rank).clone()
