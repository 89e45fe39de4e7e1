"""What a wrapped model refuses that one process allows: a parameter cast, moved or frozen after `wrap()`.

Why: a strategy lays the parameters out in its own buffers (flat buckets, fp32 masters, gradient views, shards) for
the dtype, device and trainability they had at `wrap()`. A parameter changed afterwards leaves those buffers, and the
strategy then fails inside with torch's words or, worse, trains on without a word. Each refusal names the parameter,
what it became and what to do instead. `Wrapped` (`local.py`) and `ShardedModel` (`sharded.py`) call them.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def refuse_casting(module: nn.Module, fn) -> None:
    """`model.to(...)`, `.half()`, `.double()`, `.cuda()` on a wrapped model, refused where they would change a
    parameter's dtype or device: the strategy laid the parameters out in its own buffers (flat buckets, fp32 masters,
    gradient views) for the dtype and device they had, and a cast parameter leaves them: ZeRO-2 then trained copies
    the optimizer never updates, without a word."""
    for name, p in getattr(module, "module", module).named_parameters():
        probe = fn(torch.empty(0, dtype=p.dtype, device=p.device))
        if (probe.dtype, probe.device) != (p.dtype, p.device):
            raise RuntimeError(
                _cast_refused(
                    "model.to() (or .half(), .double(), .cuda(), ...) after wrap() would",
                    name,
                    probe,
                    (p.dtype, p.device),
                )
            )


def kept_as(module: nn.Module, gathered: torch.dtype | None = None) -> list:
    """Each parameter with the dtypes and device the strategy laid it out for (`refuse_cast_since_wrap`): the one it
    had at wrap(), and `gathered`, the compute dtype a sharding strategy gathers it in (FSDP's and ZeRO-3's units,
    which a pipeline stage gathers ahead of its first forward)."""
    return [(name, p, p.dtype, gathered or p.dtype, p.device) for name, p in module.named_parameters()]


def refuse_cast_since_wrap(kept: list) -> None:
    """At each forward: a parameter cast or moved since wrap() by a path the wrapper's own `.to()` never sees
    (`model.module.half()`, a block's `.to()`, `p.data = p.data.double()`). DDP and ZeRO-1 then failed somewhere
    inside with torch's words, ZeRO-2 too except after `model.module.double()` (then it trained on copies its optimizer
    never updates), and ZeRO-3 and FSDP trained on without a word."""
    for name, p, dtype, gathered, device in kept:
        if p.dtype not in (dtype, gathered) or p.device != device:
            made = "since wrap(), something (model.module.to(), a block's .to(), p.data = ...) made"
            raise RuntimeError(_cast_refused(made, name, p, (dtype, device)))


def _cast_refused(what: str, name: str, cast, kept: tuple) -> str:
    """The refusal's words: `cast` (a tensor) is what the parameter became, `kept` the (dtype, device) it keeps."""
    return (
        f"{what} {name!r} {cast.dtype} on {cast.device}, where the strategy keeps it {kept[0]} on {kept[1]} "
        f"in its own buffers. Cast and move the model before wrap(model, ...); for 16-bit compute ask "
        f"wrap(..., mixed_precision=True)."
    )


def refuse_frozen_since_wrap(module: nn.Module, trained) -> None:
    """At the end of a backward: a parameter frozen (`requires_grad_(False)`) after wrap() is still one the strategy
    laid out to train, so it gets a zero gradient, and the optimizer still moves it (weight decay, momentum), where
    one process's optimizer skips a parameter without a gradient."""
    frozen = [p for p in trained if not p.requires_grad]
    if frozen:
        names = {p: n for n, p in module.named_parameters()}
        listed = ", ".join(repr(names.get(p, "?")) for p in frozen[:3]) + (" and more" if len(frozen) > 3 else "")
        raise RuntimeError(
            f"{listed} stopped requiring gradients after wrap(): the strategy laid them out to train, and its "
            f"optimizer would still move them (weight decay, momentum) on a zero gradient. Freeze parameters before "
            f"wrap(model, ...)."
        )
