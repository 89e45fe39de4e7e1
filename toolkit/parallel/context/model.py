"""A model made context-parallel, in place: its attention over the whole sequence, the rest on this rank's tokens.

Three things change, each found through a small protocol (the model is not rewritten):

1. attention: every module with an `attend(q, k, v)` method (the toolkit GPT's `CausalSelfAttention`, and its
   tensor-parallel form) gets, in its place, ring attention (`ring_attention.py`) or Ulysses (`ulysses.py`) over
   the cp group. Everything else in a block (layer norms, the MLP, the residual adds) is per token: untouched.
2. positions: a learned position embedding (`pos_emb`, an `nn.Embedding`) is looked up at the *global* positions
   of this rank's tokens (`sequence.SequenceSplit.positions`), not at 0..s/cp-1.
3. the model's ends, the three methods pipeline parallelism already relies on (`embed`, `hidden_shape`,
   `head_loss`): `embed` keeps this rank's tokens of the whole rows it is given (zigzag or contiguous),
   `hidden_shape` says s/cp, `head_loss` keeps the same tokens of the labels and returns the loss averaged over
   the cp ranks (`operators.mean_over_cp`), or, with no labels, the whole sequence's logits.

4. MoE layers (`toolkit.moe`): routing is per token, so each rank routes its own tokens and the layer runs as it
   is, over its expert-parallel group (ep ranks carved from dp x cp x tp: `parallel/expert_layout.py`). Only the gate's
   load-balancing loss is not per token: its counts are taken over the whole sequence (`gate.balance_over`,
   `operators.counts_over_cp`), and the model's auxiliary loss, like its loss, is the mean over the cp ranks.

So `model(x, y)` takes the whole rows, as every other strategy's model does, and returns the loss of the whole
sequence; the data-parallel strategy reduces the gradients over dp x cp (`compose.py`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from ... import comm
from .operators import CPGroup, counts_over_cp, gather_sequence, mean_over_cp
from .ring import Ring
from .ring_attention import ring_attention
from .sequence import SequenceSplit
from .ulysses import check_heads, ulysses_attention

ATTENTIONS = ("ring", "ring-unbalanced", "ulysses")
ENDS = ("embed", "hidden_shape", "head_loss")


class ContextParallel:
    """This rank's part in context parallelism: the group, how the sequence is split, which attention."""

    def __init__(self, group, attention: str):
        self.cp = CPGroup.of(group)
        self.attention = attention
        self.split = SequenceSplit(self.cp.size, self.cp.rank, zigzag=attention == "ring")

    def attend(self):
        """The function that replaces each attention module's `attend(q, k, v)` (causal, as the GPT's)."""
        if self.attention == "ulysses":
            return functools.partial(ulysses_attention, cp=self.cp, causal=True)
        return functools.partial(ring_attention, ring=Ring(self.cp.group), split=self.split, causal=True)


class ContextParallelModel:
    """Mixed into the model's class: its ends see the whole rows, its blocks this rank's tokens."""

    context: ContextParallel

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return super().embed(self.context.split.local(x))

    def hidden_shape(self, x_shape) -> tuple:
        self.context.split.check(x_shape[1])
        return super().hidden_shape((x_shape[0], x_shape[1] // self.context.cp.size, *x_shape[2:]))

    def head_loss(self, h: torch.Tensor, y):
        if y is None:
            return gather_sequence(super().head_loss(h, None), self.context.cp, self.context.split)
        return mean_over_cp(super().head_loss(h, self.context.split.local(y)), self.context.cp)

    def aux_loss(self, aux_losses: list) -> torch.Tensor:
        own = super().aux_loss(aux_losses) if hasattr(super(), "aux_loss") else sum(aux_losses)
        return mean_over_cp(own, self.context.cp)


class GlobalPositions(nn.Embedding):
    """A position embedding looked up at the global positions of this rank's tokens."""

    split: SequenceSplit

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        length = index.shape[-1] * self.split.cp
        return super().forward(self.split.positions(length, index.device)[index])


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules whose attention context parallelism can replace: those with an `attend(q, k, v)` method."""
    return [(name, m) for name, m in model.named_modules() if callable(getattr(m, "attend", None))]


def parallelize(model: nn.Module, group, attention: str = "ring") -> nn.Module:
    """Make `model` context-parallel over `group`, in place, and return it (`model.context` says how)."""
    check(model, attention, len(comm.group_ranks(group)))
    context = ContextParallel(group, attention)
    for _, module in attention_modules(model):
        module.attend = context.attend()
    for _, module in model.named_modules():  # an MoE layer's gate (toolkit.moe): balance the whole sequence
        gate = getattr(module, "gate", None)
        if hasattr(gate, "balance_over"):
            gate.balance_over = functools.partial(counts_over_cp, cp=context.cp)
    positions = getattr(model, "pos_emb", None)
    if type(positions) is nn.Embedding:
        positions.__class__ = GlobalPositions
        positions.split = context.split
    model.__class__ = type(f"ContextParallel{type(model).__name__}", (ContextParallelModel, type(model)), {})
    model.context = context
    return model


def check(model: nn.Module, attention: str, size: int, tp: int = 1) -> None:
    """What makes context parallelism over `size` ranks impossible for this model, said before any group is made
    (tp: the tensor-parallel ranks that will share each attention's heads)."""
    if attention not in ATTENTIONS:
        raise ValueError(
            f"cp_attention={attention!r} is not one of {ATTENTIONS}: 'ring' (keys and values passed "
            f"around the ranks, the sequence zigzag-split so causal work is balanced), 'ring-unbalanced' "
            f"(contiguous split, for comparison), 'ulysses' (all-to-all to a head split and back)."
        )
    found = attention_modules(model)
    missing = [end for end in ENDS if not callable(getattr(model, end, None))]
    if not found or missing:
        why = (
            "no module with an attend(q, k, v) method (the toolkit GPT's attention has one)"
            if not found
            else f"the model has no {missing} (the methods the toolkit's GPT and pipeline use to see its ends)"
        )
        raise ValueError(
            f"context parallelism (cp={size}) splits the sequence and replaces the model's attention, "
            f"but in {type(model).__name__} the toolkit cannot find it: {why}. Use a toolkit GPT "
            f"(toolkit.models.tiny_gpt or a preset), or give your model's attention module an "
            f"attend(q, k, v) method over (batch, heads, tokens, head_dim) tensors and the model "
            f"embed/hidden_shape/head_loss methods, as toolkit.models.gpt.GPT has."
        )
    dropping = [name for name, module in found if getattr(module, "attention_dropout", 0)]
    if dropping:
        raise ValueError(
            f"context parallelism (cp={size}) attends block by block, and its attention drops no weights: "
            f"{dropping[0]!r} has attention_dropout={dict(found)[dropping[0]].attention_dropout}"
            f". Build the model with attention_dropout=0 (GPT-3- and Llama-class models train without "
            f"it), or train it without cp."
        )
    if attention == "ulysses":
        for name, module in found:
            heads = getattr(module, "local_heads", None) or getattr(module, "n_head", tp) / tp
            kv_heads = getattr(module, "local_kv_heads", None) or getattr(module, "n_kv_head", heads * tp) / tp
            if heads == int(heads) and kv_heads == int(kv_heads):  # (else tensor parallelism's error to say)
                check_heads(
                    int(heads),
                    size,
                    f"{name!r}" + (f" (its share on each of tp={tp} ranks)" if tp > 1 else ""),
                    int(kv_heads),
                )
