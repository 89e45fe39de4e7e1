"""Reading a checkpoint file and checking that it fits, on every rank, before anything is written.

Shared by the full and the sharded formats (`checkpoint.py`, `checkpoint_sharded.py`): a file is read with
`torch.load(weights_only=True)` (plain tensors, numbers and strings: no arbitrary code), checked against
the model and optimizer, and the ranks agree (one all-reduce of "could I load?") before any rank writes,
so a bad file raises on every rank rather than leaving some loaded and others not.
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

from .. import comm
from ..runtime import env
from ..runtime.blame import Consequence
from ..trace.events import phase

FULL, SHARDED = "toolkit.full/1", "toolkit.fsdp_sharded/1"


# --- what a strategy holds ----------------------------------------------------------------------------------
def is_sharded(model) -> bool:
    return hasattr(model, "engine") and hasattr(model.engine, "pieces")


def replicated(model):
    """(names, the tensors the optimizer steps, the module's own parameters) of an unsharded model."""
    module = getattr(model, "module", model)
    named = list(module.named_parameters())
    master = getattr(model, "master", None)
    stepped = master.masters if master is not None else [p for _, p in named]
    return [n for n, _ in named], stepped, [p for _, p in named]


def inner(optimizer):
    return getattr(optimizer, "inner", optimizer)


def groups(optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def apply_groups(optimizer, groups: list[dict]) -> None:
    for group, saved in zip(optimizer.param_groups, groups):
        group.update(saved)


# --- reading a file, checking it fits -----------------------------------------------------------------------
def read(path: str):
    """(checkpoint, None) or (None, why it could not be read)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True), None
    except FileNotFoundError:
        return None, f"no checkpoint at {path!r}."
    except pickle.UnpicklingError as exc:
        refused = next((line.strip() for line in str(exc).splitlines() if "GLOBAL" in line), None)
        if refused is None:  # not a refusal: garbage where a pickle should be
            return None, _damaged(path, exc)
        return None, (
            f"the checkpoint {path!r} holds Python objects other than tensors, numbers and strings "
            f"({refused}), and loading them could run arbitrary code, so torch.load("
            f"weights_only=True) refused it; nothing was loaded. Toolkit checkpoints hold plain values "
            f"only: write one with save_full (or save_sharded). If you trust this file, read it "
            f"yourself with torch.load(path, weights_only=False) and pass the dict to "
            f"load_full_checkpoint.\n({type(exc).__name__}: {exc})"
        )
    except Exception as exc:  # noqa: BLE001 - any other failure to unpickle means a damaged or foreign file
        return None, _damaged(path, exc)


def _damaged(path: str, exc: Exception) -> str:
    return (
        f"could not read the checkpoint {path!r}: the file is damaged (cut short? overwritten while being "
        f"read?) or was not written by torch.save; nothing was loaded. Write it again (or copy it again) and "
        f"retry.\n({type(exc).__name__}: {exc})"
    )


def check_full(checkpoint, shapes: dict, optimizer) -> str | None:
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != FULL:
        found = checkpoint.get("format") if isinstance(checkpoint, dict) else type(checkpoint).__name__
        return (
            f"this is not a full toolkit checkpoint (format {found!r}, "
            f"expected {FULL!r}); write one with toolkit.parallel.checkpoint.save_full."
        )
    saved = checkpoint["model"]
    missing, unexpected = sorted(set(shapes) - set(saved)), sorted(set(saved) - set(shapes))
    if missing or unexpected:
        return (
            f"the checkpoint is from another model: missing parameters {missing[:5]}, unexpected "
            f"{unexpected[:5]}{' ...' if len(missing) + len(unexpected) > 10 else ''}; nothing was loaded."
        )
    wrong = [
        f"{n}: checkpoint {tuple(saved[n].shape)} vs model {tuple(s)}"
        for n, s in shapes.items()
        if tuple(saved[n].shape) != tuple(s)
    ]
    if wrong:
        return f"parameter shapes differ from this model's: {wrong[:5]}; nothing was loaded."
    kind = checkpoint["optimizer"]["type"]
    if kind != type(inner(optimizer)).__name__:
        return (
            f"the checkpoint's optimizer state is {kind}'s, this optimizer is "
            f"{type(inner(optimizer)).__name__}; build the same optimizer to load it."
        )
    for name, entry in checkpoint["optimizer"]["state"].items():
        if name not in shapes:
            return f"the optimizer state names {name!r}, which is not a parameter of this model."
        for key, value in entry.items():
            if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) != tuple(shapes[name]):
                return (
                    f"optimizer state {name}.{key} has shape {tuple(value.shape)}, the parameter {tuple(shapes[name])}."
                )
    return None


def check_slices(checkpoint, engine) -> str | None:
    """A sharded optimizer keeps one state per slice: every parameter of a slice must agree."""
    state = checkpoint["optimizer"]["state"]
    for piece in engine.pieces:
        entries = [state.get(engine.names[p], {}) for p in piece.params]
        if any(set(e) != set(entries[0]) for e in entries):
            return (
                f"parameters {[engine.names[p] for p in piece.params][:3]}... are stepped together here, "
                f"but only some of them have optimizer state in the checkpoint."
            )
        for key, value in entries[0].items():
            if not (torch.is_tensor(value) and value.dim() > 0) and any(
                not torch.equal(torch.as_tensor(e[key]), torch.as_tensor(value)) for e in entries
            ):
                return f"optimizer state {key!r} differs between parameters stepped together ({piece!r})."
    return None


def distributed(model) -> bool:
    return is_sharded(model) or hasattr(model, "group") or getattr(model, "tensor_parallel", None) is not None


class AnotherRankCouldNotLoad(Consequence, ValueError):
    """Raised on the ranks that could load, when another could not: a consequence, not the cause."""


def agree(model, error: str | None) -> None:
    """Raise on every rank if any rank found a problem (so no rank loads while another does not)."""
    if dist.is_initialized() and distributed(model):
        group = getattr(model, "group", None) if not is_sharded(model) else None
        ranks = comm.group_ranks(group)
        flags = torch.zeros(len(ranks), device=env.device())
        flags[ranks.index(dist.get_rank())] = float(error is not None)
        with phase("checkpoint"):
            comm.all_reduce(flags, group=group)
        failed = [r for r, flag in zip(ranks, flags.tolist()) if flag]
        if failed and error is None:
            raise AnotherRankCouldNotLoad(
                f"rank{'s' * (len(failed) > 1)} {', '.join(map(str, failed))} could not load the checkpoint (its own "
                f"error says why); nothing was loaded on this rank either, so every rank still holds the same model."
            )
    if error is not None:
        raise ValueError(error)
