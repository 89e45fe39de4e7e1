"""Activation checkpointing for every strategy: keep a block's input, recompute its inside in backward.

    model, opt = toolkit.parallel.wrap(model, "zero2", activation_checkpointing=True)
    model, opt = toolkit.parallel.wrap(model, "fsdp", activation_checkpointing=2)  # every 2nd block only
    model, opt = toolkit.parallel.wrap(model, "ddp", tp=8, sequence_parallel=True, activation_checkpointing="attention")

A transformer keeps about s·b·h·34 bytes per layer for backward (Korthikanti et al.); under checkpointing a
block keeps only its input (2·s·b·h in 16 bits) and runs its forward again when backward reaches it, one
more forward of compute for most of the activation memory. The blocks are the ones FSDP makes units of
(`fsdp_policy.default_units`: every toolkit Block, else the model's repeated layers). FSDP applies it per
unit itself, inside its gather/free hooks; every other strategy gets it here, before it wraps the model.
Under tensor parallelism the recomputed forward issues its g all-reduces again (Megatron's full
recomputation does the same), and draws the dropout masks of split regions from the tensor-parallel stream as
it was in the forward (`rng.py`; torch's checkpoint replays the default stream itself).

A whole number k checkpoints every k-th block (the k-th, 2k-th, ... in the model's order) and keeps the others'
activations: a trade between memory and recomputation in steps of 1/k, as fms-fsdp's `selective_checkpointing`
and torchtitan's layer-wise selective checkpointing (`selective_ac_option="2"`) count blocks. True is 1. "op"
checkpoints every block by operation, keeping the outputs of its matmuls (every other one) and attention and
recomputing the rest (torchtitan's `selective_ac_option="op"`: `checkpoint_ops.py`). "attention" keeps every
block's activations but those of its core attention (QKᵀ, softmax, its dropout, the product with V: every module's
`attend(q, k, v)`), which it recomputes from Q, K and V: Megatron-LM's selective recomputation
(`--recompute-granularity selective`, Korthikanti et al. 2022). Those are the 5·a·s/h of a layer's s·b·h·(34 +
5·a·s/h) bytes that grow with the sequence, for a few percent more FLOPs; a fused attention (FlashAttention) never
stores its scores, and there it saves only the log-sum-exp.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from . import rng
from .checkpoint_ops import selective_contexts
from .fsdp_policy import default_units

BY_OPERATION = "op"  # activation_checkpointing="op": every block, by operation (checkpoint_ops.py)
ATTENTION = "attention"  # activation_checkpointing="attention": every block's core attention (Megatron's selective)


def checkpoint_forward(module: nn.Module, by_operation: bool = False, method: str = "forward") -> None:
    """Run `module.forward` (or another `method`) under activation checkpointing (non-reentrant; by operation:
    torch's selective checkpointing under `checkpoint_ops`' policy). Under FSDP the unit's hooks stay outside: in
    backward the unit is gathered (pre-backward hook) before autograd asks for the recomputation."""
    forward = getattr(module, method)
    contexts = selective_contexts if by_operation else rng.checkpoint_contexts

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)

    setattr(module, method, checkpointed)


def without_cache(model: nn.Module) -> None:
    """A transformers model keeps a key-value cache unless told not to, and a recomputed forward would add its keys
    and values to it a second time (a longer cache, another path through its attention). transformers turns the cache
    off under its own gradient checkpointing ("`use_cache=True` is incompatible with gradient checkpointing"); so does
    the toolkit's."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False


def period(flag, where: str = "") -> int:
    """The blocks `activation_checkpointing=flag` recomputes, as k (every k-th block): False 0, True, "op" and
    "attention" 1."""
    if flag in (BY_OPERATION, ATTENTION) or isinstance(flag, bool):
        return int(bool(flag))
    if isinstance(flag, int) and flag >= 1:
        return flag
    raise ValueError(
        f"{where}activation_checkpointing must be True (every block), False (none), a whole number k >= 1 "
        f'(every k-th block: 2 recomputes half of them), "op" (every block by operation: its matmuls\' and '
        f"attention's outputs kept) or \"attention\" (every block's core attention, Megatron's selective "
        f"recomputation), got {flag!r}."
    )


def blocks_recomputed(flag) -> int:
    """k where `activation_checkpointing=flag` runs every k-th block's forward again whole (its collectives too), 0
    where it runs none: "attention" recomputes the core attention inside each block, which talks to no one."""
    return 0 if flag == ATTENTION else period(flag)


def every(names: list, k: int) -> list:
    """The k-th, 2k-th, ... of `names` (none for k = 0): the blocks checkpointed at period k."""
    return names[k - 1 :: k] if k else []


def core_attentions(model: nn.Module, blocks: list) -> list:
    """The modules inside `blocks` whose core attention is their `attend(q, k, v)` (the toolkit GPT's attention, in
    any kernels' style); none in a model that computes attention inside its forward (a transformers model)."""
    found = [m for block in blocks for m in block.modules() if callable(getattr(m, "attend", None))]
    if not found:
        raise ValueError(
            f'activation_checkpointing="attention" recomputes the core attention of modules with an attend(q, k, '
            f"v) method (the toolkit GPT's attention has one), and this {type(model).__name__} has none; use "
            f'activation_checkpointing=True, a whole number k, or "op".'
        )
    return found


def checkpoint_modules(model: nn.Module, blocks: list, flag) -> None:
    """Checkpoint the blocks `activation_checkpointing=flag` names among `blocks` (the model's repeated blocks, in
    order): every k-th, by operation for "op", their core attention alone for "attention"; a transformers model's
    cache turned off."""
    if flag == ATTENTION:
        for attention in core_attentions(model, blocks):
            checkpoint_forward(attention, method="attend")
        return
    chosen = every(blocks, period(flag))
    if chosen:
        without_cache(model)
    for block in chosen:
        checkpoint_forward(block, flag == BY_OPERATION)


def checkpoint_blocks(model: nn.Module, flag=True) -> None:
    """Run the repeated blocks `activation_checkpointing=flag` names under torch.utils.checkpoint (non-reentrant; by
    operation: selective checkpointing)."""
    names, _ = default_units(model)
    if not names:
        raise ValueError(
            f"activation_checkpointing={flag!r} checkpoints a model's repeated blocks, and this "
            f"{type(model).__name__} has none (no toolkit Block, no ModuleList or Sequential of one "
            f"class); leave the option off, or wrap parts of it in torch.utils.checkpoint yourself."
        )
    modules = dict(model.named_modules())
    checkpoint_modules(model, [modules[name] for name in names], flag)


def apply_option(model: nn.Module, strategy: str, options: dict) -> dict:
    """Take `activation_checkpointing` out of a strategy's options (FSDP keeps its own), applying it."""
    if strategy == "fsdp" or "activation_checkpointing" not in options:
        return options
    options = dict(options)
    flag = options.pop("activation_checkpointing")
    if period(flag):
        checkpoint_blocks(model, flag)
    return options
