"""Checkpoints: a full one that every strategy can write and read, and FSDP's sharded one.

Two ways to save a sharded model, as in torch FSDP:

* **Full** (`save_full` / `load_full`): every parameter whole, under its original name, with the
  optimizer's state whole too (Adam's two moments per parameter, its step count), in fp32. Gathering
  it costs an all-gather of the shards, and rank 0 alone writes the file. It does not remember how it
  was sharded, so it loads into any strategy at any world size: FSDP on 2 ranks -> "local" -> ZeRO-2
  on 4 ranks -> FSDP on 3 ranks, all holding the same parameters and optimizer state.
* **Sharded** (`save_sharded` / `load_sharded`, FSDP only): each rank writes its own slices, no
  communication, no rank holding more than its share: what a model too big for one rank needs. It
  loads back only into the same layout (world size, sharding factor, units); to change the world
  size, go through a full checkpoint.

Loading checks everything first (format, names, shapes, the optimizer's kind and its state's shapes)
and writes nothing unless all of it fits; ranks agree before anyone writes, so a bad file raises on
every rank rather than leaving some loaded and others not. Files are read with
`torch.load(weights_only=True)`: plain tensors, numbers and strings, no arbitrary code.

The full format (portable, keyed by name; a tied weight appears once, under its first name):

    {"format": "toolkit.full/1",
     "model": {name: tensor},
     "optimizer": {"type": "AdamW", "param_groups": [{"lr": ..., ...}], "state": {name: {"step": ..., "exp_avg": ...}}}}
"""
from __future__ import annotations

import os
import pickle

import torch
import torch.distributed as dist

from .. import comm
from ..runtime import env
from ..runtime.blame import Consequence
from ..trace.events import phase
from .flat import FlatBuffer

FULL, SHARDED = "toolkit.full/1", "toolkit.fsdp_sharded/1"


# --- what a strategy holds ---------------------------------------------------------------------------
def _is_sharded(model) -> bool:
    return hasattr(model, "engine") and hasattr(model.engine, "pieces")


def _replicated(model):
    """(names, the tensors the optimizer steps, the module's own parameters) of an unsharded model."""
    module = getattr(model, "module", model)
    named = list(module.named_parameters())
    master = getattr(model, "master", None)
    stepped = master.masters if master is not None else [p for _, p in named]
    return [n for n, _ in named], stepped, [p for _, p in named]


def _inner(optimizer):
    return getattr(optimizer, "inner", optimizer)


def _groups(optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


# --- full checkpoints ----------------------------------------------------------------------------------
@torch.no_grad()
def full_checkpoint(model, optimizer, *, rank0_only: bool = True) -> dict | None:
    """The whole model and optimizer state in the portable format, on CPU. Every rank must call it
    (a sharded model all-gathers); with rank0_only, ranks other than 0 get None."""
    params, state = {}, {}
    if _is_sharded(model):
        engine = model.engine
        with phase("checkpoint"):
            for piece in engine.pieces:
                full = _gather(piece.mine.master, piece.flat.shapes, engine)
                params.update({engine.names[p]: v for p, v in zip(piece.params, full)})
                per_param = [{} for _ in piece.params]
                for key, value in sorted(_inner(optimizer).state.get(piece.mine.master, {}).items()):
                    if torch.is_tensor(value) and value.shape == piece.mine.master.shape:
                        parts = _gather(value, piece.flat.shapes, engine)
                    else:  # a scalar (Adam's step): the same for every parameter of the slice
                        parts = [value.clone() if torch.is_tensor(value) else value] * len(piece.params)
                    for entry, part in zip(per_param, parts):
                        entry[key] = part
                state.update({engine.names[p]: s for p, s in zip(piece.params, per_param) if s})
        params.update({engine.names[p]: p.detach().float().clone() for p in engine.frozen})
    else:
        names, stepped, _ = _replicated(model)
        for name, t in zip(names, stepped):
            params[name] = t.detach().float().clone()
            if t in optimizer.state:
                state[name] = {k: v.detach().clone() if torch.is_tensor(v) else v
                               for k, v in optimizer.state[t].items()}
    if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
        return None
    cpu = {n: t.cpu() for n, t in params.items()}
    state = {n: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()} for n, s in state.items()}
    return {"format": FULL, "model": cpu, "optimizer": {
        "type": type(_inner(optimizer)).__name__, "param_groups": _groups(optimizer), "state": state}}


def _gather(shard: torch.Tensor, shapes, engine) -> list[torch.Tensor]:
    full = FlatBuffer(shapes, engine.world, dtype=torch.float32, device=shard.device)
    comm.all_gather(full.data, shard.detach().float(), group=engine.group)
    return [v.clone() for v in full.views()]


def save_full(model, optimizer, path: str) -> None:
    """Gather the full checkpoint and write it from rank 0 (every rank must call this)."""
    if getattr(model, "tensor_parallel", None) is not None:  # tensor-parallel pieces joined (tensor/checkpoint.py)
        from .tensor import checkpoint as tensor_parallel
        checkpoint = tensor_parallel.join(model, full_checkpoint(model, optimizer, rank0_only=False))
    else:
        checkpoint = full_checkpoint(model, optimizer, rank0_only=True)
    if checkpoint is not None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        torch.save(checkpoint, path)
    if dist.is_initialized() and _distributed(model):
        comm.barrier()  # nobody reads the file before it is complete


def load_full(model, optimizer, path: str) -> None:
    """Read a full checkpoint (every rank reads the file: it must be visible to all) and load it."""
    checkpoint, error = _read(path)
    if getattr(model, "tensor_parallel", None) is not None:  # this rank's tensor-parallel pieces of it
        from .tensor import checkpoint as tensor_parallel
        checkpoint = tensor_parallel.cut(model, checkpoint)
    load_full_checkpoint(model, optimizer, checkpoint, _error=error)


@torch.no_grad()
def load_full_checkpoint(model, optimizer, checkpoint: dict, *, _error: str | None = None) -> None:
    """Load the portable format into `model` and `optimizer`, whatever the strategy and world size."""
    if _is_sharded(model):
        engine = model.engine
        names = [engine.names[p] for piece in engine.pieces for p in piece.params]
        shapes = [p.shape for piece in engine.pieces for p in piece.params]
        names += [engine.names[p] for p in engine.frozen]
        shapes += [p.shape for p in engine.frozen]
    else:
        names, stepped, _ = _replicated(model)
        shapes = [t.shape for t in stepped]
    error = _error or _check_full(checkpoint, dict(zip(names, shapes)), optimizer)
    if error is None and _is_sharded(model):
        error = _check_slices(checkpoint, engine)
    _agree(model, error)
    _apply_groups(optimizer, checkpoint["optimizer"]["param_groups"])
    state = checkpoint["optimizer"]["state"]
    device = env.device() if _distributed(model) else None
    if _is_sharded(model):
        for piece in engine.pieces:
            piece_names = [engine.names[p] for p in piece.params]
            piece.mine.master.copy_(_slice([checkpoint["model"][n] for n in piece_names], piece, engine))
            entries = [state.get(n, {}) for n in piece_names]
            if not entries[0]:
                _inner(optimizer).state.pop(piece.mine.master, None)
                continue
            loaded = {}
            for key, value in entries[0].items():
                if torch.is_tensor(value) and value.dim() > 0:
                    loaded[key] = _slice([e[key] for e in entries], piece, engine)
                else:
                    loaded[key] = value.clone().to(piece.mine.master.device) if torch.is_tensor(value) else value
            _inner(optimizer).state[piece.mine.master] = loaded
        for p in engine.frozen:
            p.copy_(checkpoint["model"][engine.names[p]])
        engine.after_step()  # each strategy's own "masters -> model" (ZeRO-1/2 all-gather them)
    else:
        names, stepped, module_params = _replicated(model)
        for name, t, p in zip(names, stepped, module_params):
            t.copy_(checkpoint["model"][name])
            if p is not t:
                p.copy_(t)  # mixed precision: the 16-bit parameter is the rounded master
            if name in state:
                optimizer.state[t] = {k: v.clone().to(device or t.device) if torch.is_tensor(v) else v
                                      for k, v in state[name].items()}
            else:
                optimizer.state.pop(t, None)


def _slice(tensors, piece, engine) -> torch.Tensor:
    full = FlatBuffer(piece.flat.shapes, engine.world, dtype=torch.float32, device=piece.mine.master.device)
    full.copy_from([t.to(full.data.device) for t in tensors])
    return full.shard(engine.rank).clone()


def _apply_groups(optimizer, groups: list[dict]) -> None:
    for group, saved in zip(optimizer.param_groups, groups):
        group.update(saved)


# --- checks -----------------------------------------------------------------------------------------
def _read(path: str):
    """(checkpoint, None) or (None, why it could not be read)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True), None
    except FileNotFoundError:
        return None, f"no checkpoint at {path!r}."
    except pickle.UnpicklingError as exc:
        refused = next((line.strip() for line in str(exc).splitlines() if "GLOBAL" in line), None)
        if refused is None:  # not a refusal: garbage where a pickle should be
            return None, _damaged(path, exc)
        return None, (f"the checkpoint {path!r} holds Python objects other than tensors, numbers and strings "
                      f"({refused}), and loading them could run arbitrary code, so torch.load("
                      f"weights_only=True) refused it; nothing was loaded. Toolkit checkpoints hold plain values "
                      f"only: write one with save_full (or save_sharded). If you trust this file, read it "
                      f"yourself with torch.load(path, weights_only=False) and pass the dict to "
                      f"load_full_checkpoint.\n({type(exc).__name__}: {exc})")
    except Exception as exc:  # noqa: BLE001 - any other failure to unpickle means a damaged or foreign file
        return None, _damaged(path, exc)


def _damaged(path: str, exc: Exception) -> str:
    return (f"could not read the checkpoint {path!r}: the file is damaged (cut short? overwritten while being "
            f"read?) or was not written by torch.save; nothing was loaded. Write it again (or copy it again) and "
            f"retry.\n({type(exc).__name__}: {exc})")


def _check_full(checkpoint, shapes: dict, optimizer) -> str | None:
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != FULL:
        return (f"this is not a full toolkit checkpoint (format {checkpoint.get('format') if isinstance(checkpoint, dict) else type(checkpoint).__name__!r}, "
                f"expected {FULL!r}); write one with toolkit.parallel.checkpoint.save_full.")
    saved = checkpoint["model"]
    missing, unexpected = sorted(set(shapes) - set(saved)), sorted(set(saved) - set(shapes))
    if missing or unexpected:
        return (f"the checkpoint is from another model: missing parameters {missing[:5]}, unexpected "
                f"{unexpected[:5]}{' ...' if len(missing) + len(unexpected) > 10 else ''}; nothing was loaded.")
    wrong = [f"{n}: checkpoint {tuple(saved[n].shape)} vs model {tuple(s)}" for n, s in shapes.items()
             if tuple(saved[n].shape) != tuple(s)]
    if wrong:
        return f"parameter shapes differ from this model's: {wrong[:5]}; nothing was loaded."
    kind = checkpoint["optimizer"]["type"]
    if kind != type(_inner(optimizer)).__name__:
        return (f"the checkpoint's optimizer state is {kind}'s, this optimizer is "
                f"{type(_inner(optimizer)).__name__}; build the same optimizer to load it.")
    for name, entry in checkpoint["optimizer"]["state"].items():
        if name not in shapes:
            return f"the optimizer state names {name!r}, which is not a parameter of this model."
        for key, value in entry.items():
            if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) != tuple(shapes[name]):
                return f"optimizer state {name}.{key} has shape {tuple(value.shape)}, the parameter {tuple(shapes[name])}."
    return None


def _check_slices(checkpoint, engine) -> str | None:
    """A sharded optimizer keeps one state per slice: every parameter of a slice must agree."""
    state = checkpoint["optimizer"]["state"]
    for piece in engine.pieces:
        entries = [state.get(engine.names[p], {}) for p in piece.params]
        if any(set(e) != set(entries[0]) for e in entries):
            return (f"parameters {[engine.names[p] for p in piece.params][:3]}... are stepped together here, "
                    f"but only some of them have optimizer state in the checkpoint.")
        for key, value in entries[0].items():
            if not (torch.is_tensor(value) and value.dim() > 0) and any(
                    not torch.equal(torch.as_tensor(e[key]), torch.as_tensor(value)) for e in entries):
                return f"optimizer state {key!r} differs between parameters stepped together ({piece!r})."
    return None


def _distributed(model) -> bool:
    return _is_sharded(model) or hasattr(model, "group") or getattr(model, "tensor_parallel", None) is not None


class AnotherRankCouldNotLoad(Consequence, ValueError):
    """Raised on the ranks that could load, when another could not: a consequence, not the cause."""


def _agree(model, error: str | None) -> None:
    """Raise on every rank if any rank found a problem (so no rank loads while another does not)."""
    if dist.is_initialized() and _distributed(model):
        group = getattr(model, "group", None) if not _is_sharded(model) else None
        ranks = comm.group_ranks(group)
        flags = torch.zeros(len(ranks), device=env.device())
        flags[ranks.index(dist.get_rank())] = float(error is not None)
        with phase("checkpoint"):
            comm.all_reduce(flags, group=group)
        failed = [r for r, flag in zip(ranks, flags.tolist()) if flag]
        if failed and error is None:
            raise AnotherRankCouldNotLoad(
                f"rank{'s' * (len(failed) > 1)} {', '.join(map(str, failed))} could not load the checkpoint (its own "
                f"error says why); nothing was loaded on this rank either, so every rank still holds the same model.")
    if error is not None:
        raise ValueError(error)


# --- sharded checkpoints (FSDP) ------------------------------------------------------------------------
def _layout(model) -> dict:
    engine = model.engine
    return {"world_size": dist.get_world_size(), "sharding_group_size": engine.world,
            "units": [{"name": u.name, "params": list(u.param_names), "shapes": [list(s) for s in u.flat.shapes]}
                      for u in engine.units]}


def sharded_checkpoint(model, optimizer) -> dict:
    """This rank's slices and their optimizer state, as they are: no communication."""
    if not hasattr(model, "units"):
        raise ValueError("sharded checkpoints are FSDP's (wrap(model, 'fsdp')); use save_full for other strategies.")
    units = model.engine.units
    return {"format": SHARDED, **_layout(model), "rank": dist.get_rank(),
            "masters": [u.master.detach().cpu().clone() for u in units],
            "optimizer": {"type": type(_inner(optimizer)).__name__, "param_groups": _groups(optimizer),
                          "state": [{k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                                     for k, v in _inner(optimizer).state.get(u.master, {}).items()} for u in units]}}


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
    checkpoint, error = _read(path)
    if error and os.path.isdir(directory) and not os.path.exists(path):
        error += (f" The directory holds {sorted(os.listdir(directory))[:4]}: a sharded checkpoint loads only into "
                  f"the world size it was saved from; use a full checkpoint to change it.")
    if error is None:
        error = _check_sharded(checkpoint, model, optimizer)
    _agree(model, error)
    _apply_groups(optimizer, checkpoint["optimizer"]["param_groups"])
    for unit, master, state in zip(model.engine.units, checkpoint["masters"], checkpoint["optimizer"]["state"]):
        unit.master.copy_(master)
        if state:
            _inner(optimizer).state[unit.master] = {k: v.clone().to(unit.master.device) if torch.is_tensor(v) else v
                                                    for k, v in state.items()}
        else:
            _inner(optimizer).state.pop(unit.master, None)


def _check_sharded(checkpoint, model, optimizer) -> str | None:
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != SHARDED:
        return f"this is not an FSDP sharded checkpoint (expected format {SHARDED!r}); nothing was loaded."
    mine = _layout(model)
    for key in ("world_size", "sharding_group_size"):
        if checkpoint[key] != mine[key]:
            return (f"the sharded checkpoint was saved with {key}={checkpoint[key]}, this model has {mine[key]}: "
                    f"sharded checkpoints load only into the same layout. Save a full checkpoint "
                    f"(save_full) to change it; nothing was loaded.")
    if checkpoint["units"] != mine["units"]:
        return ("the sharded checkpoint's units (names, parameters, shapes) differ from this model's: another "
                "model or another wrap policy; nothing was loaded.")
    if checkpoint["optimizer"]["type"] != type(_inner(optimizer)).__name__:
        return f"the checkpoint's optimizer state is {checkpoint['optimizer']['type']}'s; build the same optimizer."
    for unit, master in zip(model.engine.units, checkpoint["masters"]):
        if master.shape != unit.master.shape:
            return f"unit {unit.name!r}: saved slice of {tuple(master.shape)} vs {tuple(unit.master.shape)} here."
    return None
