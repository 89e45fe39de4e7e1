"""Full checkpoints of a pipeline: saved at one (dp, pp, tp) layout, loaded at another, bit for bit.

The full format (`toolkit.parallel.checkpoint`) holds every parameter whole under its original name, with
its optimizer state beside it; it does not know how the model was laid out. A pipeline completes it:

    save  each of this rank's stages writes what its data-parallel strategy holds, whole over dp
          (`full_checkpoint`), its tensor-parallel pieces are joined (`tensor/checkpoint.py`), then every
          stage's entries are brought together from the pipeline group; rank 0 writes the file
    load  every rank reads the file; each stage takes its own parameters (and their optimizer state), cut
          to its tensor-parallel pieces, and loads them with its strategy's own loader

A tied embedding appears once, as in a one-process model: the first stage trains it and saves it; the last
stage's borrowed copy is refreshed from it at the next step.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ... import comm
from .. import checkpoint as full
from ..checkpoint_checks import FULL, read
from ..tensor import checkpoint as tensor_parallel


def full_checkpoint(model, optimizer) -> dict:
    """The whole model's full checkpoint, on every rank (every rank must call it)."""
    params, state, groups, kind = {}, {}, None, None
    for wrapped, opt in zip(model.stages.values(), optimizer.optimizers):
        part = full.full_checkpoint(wrapped, opt, rank0_only=False)
        params.update(part["model"])
        state.update(part["optimizer"]["state"])
        groups, kind = groups or part["optimizer"]["param_groups"], part["optimizer"]["type"]
    checkpoint = {"format": FULL, "model": params, "optimizer": {"type": kind, "param_groups": groups, "state": state}}
    if model.tp_info is not None:
        checkpoint = tensor_parallel.join(SimpleNamespace(tensor_parallel=model.tp_info), checkpoint, rank0_only=False)
    everyone = exchange(
        {"model": checkpoint["model"], "state": checkpoint["optimizer"]["state"]}, model.driver.group, tensors=False
    )
    checkpoint["model"] = {n: t for part in everyone for n, t in part["model"].items()}
    checkpoint["optimizer"]["state"] = {n: s for part in everyone for n, s in part["state"].items()}
    return checkpoint


def save_full(model, optimizer, path: str) -> None:
    checkpoint = full_checkpoint(model, optimizer)
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        torch.save(checkpoint, path)
    comm.barrier()  # nobody reads the file before it is complete


def load_full(model, optimizer, path: str) -> None:
    """Load a full checkpoint into this rank's stages (every rank reads the file: it must be visible to all)."""
    checkpoint, error = read(path)
    if error is None:
        names = model.pipeline["names"]
        saved = set(checkpoint.get("model", {})) if isinstance(checkpoint, dict) else set()
        if isinstance(checkpoint, dict) and checkpoint.get("format") == FULL and saved != set(names):
            error = (
                f"the checkpoint is from another model: missing parameters {sorted(set(names) - saved)[:5]}, "
                f"unexpected {sorted(saved - set(names))[:5]}; nothing was loaded."
            )
    if error is not None:  # every rank read the same file, so every rank raises here
        raise ValueError(error)
    for wrapped, opt in zip(model.stages.values(), optimizer.optimizers):
        mine = [n for n, _ in wrapped.module.named_parameters()]
        part = {
            "format": FULL,
            "model": {n: checkpoint["model"][n] for n in mine},
            "optimizer": dict(
                checkpoint["optimizer"], state={n: s for n, s in checkpoint["optimizer"]["state"].items() if n in mine}
            ),
        }
        if model.tp_info is not None:
            part = tensor_parallel.cut(wrapped, part, model.tp_info)  # the stage's strategy knows its shapes
        full.load_full_checkpoint(wrapped, opt, part)


def exchange(state: dict, group, tensors: bool = True):
    """Every pipeline rank's entries, on every pipeline rank: merged (tensors=True, a dict of tensors) or as
    the list of each rank's object. Bookkeeping, as a checkpoint's: a raw object all-gather, unrecorded."""
    everyone = [None] * dist.get_world_size(group)
    mine = {n: t.detach().cpu() for n, t in state.items()} if tensors else state
    dist.all_gather_object(everyone, mine, group=group)
    if not tensors:
        return everyone
    merged: dict = {}
    for part in everyone:
        merged.update(part)
    return merged
