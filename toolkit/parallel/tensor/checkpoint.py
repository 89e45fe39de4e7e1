"""Full checkpoints of a tensor-parallel model: saved at one (dp, tp) layout, loaded at another, bit for bit.

The full checkpoint format (`toolkit.parallel.checkpoint`) holds every parameter whole under its original
name, with its optimizer state whole beside it. Under tensor parallelism the data-parallel strategy writes
what one tensor-parallel rank holds (its pieces, whole over dp); this file completes the two ends:

    save  the strategy's checkpoint on every rank -> each split entry (the parameter and every optimizer
          state of its shape, Adam's two moments) all-gathered over the tp group and joined (`Split.join`)
    load  the file's full tensors -> each split entry cut to this rank's piece (`Split.shard`) -> the
          strategy's own loader, which shards over dp as ever

Joining and cutting are exact inverses of the same `Split`, and the values are fp32, so a checkpoint saved
at dp 2 x tp 2 loads at tp 1 (any strategy), at tp 4, or back, to the bit; the file does not know it came
from a tensor-parallel run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import parameter_shapes


def join(model, checkpoint: dict, rank0_only: bool = True) -> dict | None:
    """A full checkpoint from every rank's (tp-local) one; every rank of the world must call it."""
    info = model.tensor_parallel
    checkpoint = dict(checkpoint, model=info.gather(checkpoint["model"]))
    optimizer = checkpoint["optimizer"]
    state = {
        name: {k: info.gather_tensor(name, v) if torch.is_tensor(v) and v.dim() else v for k, v in entry.items()}
        for name, entry in optimizer["state"].items()
    }
    checkpoint["optimizer"] = dict(optimizer, state={n: {k: _cpu(v) for k, v in e.items()} for n, e in state.items()})
    checkpoint["model"] = {n: _cpu(v) for n, v in checkpoint["model"].items()}
    if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
        return None
    return checkpoint


def cut(model, checkpoint, info=None) -> dict:
    """This rank's pieces of a full checkpoint (left as it is when it does not look like one: the strategy's
    loader then says what is wrong with it). `info`: the layout's `TensorParallel`, `model.tensor_parallel` if not
    given (a pipeline stage's wrapped model does not carry it)."""
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("model"), dict):
        return checkpoint
    info = info if info is not None else model.tensor_parallel
    pieces = parameter_shapes(model)
    if any(
        not _fits(checkpoint["model"].get(n), pieces[n], info.splits[n], info.tp.size)
        for n in pieces
        if info.is_split(n) and n in checkpoint["model"]
    ):
        return checkpoint
    state = checkpoint.get("optimizer", {}).get("state", {})
    state = {
        name: {k: info.shard_tensor(name, v) if torch.is_tensor(v) and v.dim() else v for k, v in entry.items()}
        for name, entry in state.items()
    }
    return dict(checkpoint, model=info.shard(checkpoint["model"]), optimizer=dict(checkpoint["optimizer"], state=state))


def _fits(full, piece_shape, split, tp: int) -> bool:
    if not torch.is_tensor(full) or full.dim() != len(piece_shape):
        return False
    want = list(piece_shape)
    want[split.dim] = split.full_size(want[split.dim], tp)  # a padded vocabulary's file holds its real words only
    return list(full.shape) == want


def _cpu(value):
    return value.cpu() if torch.is_tensor(value) else value
