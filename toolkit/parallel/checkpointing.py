"""Activation checkpointing for every strategy: keep a block's input, recompute its inside in backward.

    model, opt = toolkit.parallel.wrap(model, "zero2", activation_checkpointing=True)

A transformer keeps about s·b·h·34 bytes per layer for backward (Korthikanti et al.); under checkpointing a
block keeps only its input (2·s·b·h in 16 bits) and runs its forward again when backward reaches it, one
more forward of compute for most of the activation memory. The blocks are the ones FSDP makes units of
(`fsdp_policy.default_units`: every toolkit Block, else the model's repeated layers). FSDP applies it per
unit itself, inside its gather/free hooks; every other strategy gets it here, before it wraps the model.
Under tensor parallelism the recomputed forward issues its g all-reduces again (Megatron's full
recomputation does the same), and draws the dropout masks of split regions from the tensor-parallel stream as
it was in the forward (`rng.py`; torch's checkpoint replays the default stream itself).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from . import rng
from .fsdp_policy import default_units


def checkpoint_forward(module: nn.Module) -> None:
    """Run `module.forward` under activation checkpointing (non-reentrant). Under FSDP the unit's hooks stay
    outside: in backward the unit is gathered (pre-backward hook) before autograd asks for the recomputation."""
    forward = module.forward

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(
            forward, *args, use_reentrant=False, context_fn=rng.checkpoint_contexts, **kwargs
        )

    module.forward = checkpointed


def checkpoint_blocks(model: nn.Module) -> list[str]:
    """Run each repeated block's forward under torch.utils.checkpoint (non-reentrant); return their names."""
    names, _ = default_units(model)
    if not names:
        raise ValueError(
            f"activation_checkpointing=True checkpoints a model's repeated blocks, and this "
            f"{type(model).__name__} has none (no toolkit Block, no ModuleList or Sequential of one "
            f"class); leave the option off, or wrap parts of it in torch.utils.checkpoint yourself."
        )
    modules = dict(model.named_modules())
    for name in names:
        checkpoint_forward(modules[name])
    return names


def apply_option(model: nn.Module, strategy: str, options: dict) -> dict:
    """Take `activation_checkpointing` out of a strategy's options (FSDP keeps its own), applying it."""
    if strategy == "fsdp" or "activation_checkpointing" not in options:
        return options
    options = dict(options)
    flag = options.pop("activation_checkpointing")
    if not isinstance(flag, bool):
        raise ValueError(f"activation_checkpointing must be True or False, got {flag!r}.")
    if flag:
        checkpoint_blocks(model)
    return options
