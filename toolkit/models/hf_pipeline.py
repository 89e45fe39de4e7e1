"""Hugging Face models read as a pipeline reads a model: embed, the repeated layers, the head and its loss.

A pipeline runs a model in three parts on different ranks (`toolkit.parallel.pipeline.split`): `embed(x)` on the
first stage, the layers spread over the stages, each called `layer(h)`, and `head_loss(h, y)` on the last. A
Hugging Face model runs all three inside its own forward, and its layers need more than h: a decoder layer
takes the causal mask, the position ids and (Llama-likes) the rotary position embeddings, which the model
computes once before its first layer. `pipelined(model)` gives the model the three parts, in place (its class
gains them; names and parameters stay), and gives each layer what it needs from h alone, as its model would:

    family        the parts (paths in the task model)                             what each layer is given
    gpt2          embed: transformer.drop(wte(x) + wpe(positions))                 the causal mask
                  layers: transformer.h;  head: lm_head(transformer.ln_f(h))
    llama-like    embed: model.embed_tokens(x)                                      position ids, rotary (cos, sin)
    (llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe)                   from model.rotary_emb, the causal
                  layers: model.layers;  head: lm_head(model.norm(h))               (or sliding-window) mask
    bert-like     embed: <base>.embeddings(input_ids=x)                             the bidirectional mask
    (bert, roberta) layers: <base>.encoder.layer;  head: cls / lm_head (h)
    vit           embed: vit.embeddings(pixel_values);  layers: vit.layers          nothing
                  head: classifier(vit.layernorm(h)[:, 0])

The loss is the model's own, on the head's logits, as `protocol.py` calls it (a causal LM's `loss_function` with
`shift_labels`, a masked LM's cross-entropy over the masked positions, a classifier's `loss_function`).

Anything else: give the model the three parts yourself, a short adapter (toolkit.models.GPT shows the shape):

    class MyPipelined(MyModel):
        def embed(self, x):           return self.embeddings(x)                    # first stage
        def head_loss(self, h, y):    return loss_of(self.head(self.norm(h)), y)   # last stage (logits if y is None)
        def hidden_shape(self, shape): return (shape[0], shape[1], self.config.hidden_size)
    model.__class__ = MyPipelined    # its repeated layers must be callable as layer(h): a pre-hook can add inputs
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .protocol import recognise

PROTOCOL = ("embed", "head_loss", "hidden_shape")
LLAMA_LIKE = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


@dataclass(frozen=True)
class Family:
    name: str
    layers: Callable  # (model) -> the layers' path in the task model
    embed: Callable  # (model, inputs) -> h
    head: Callable  # (model, h) -> logits
    layer_inputs: Callable | None = None  # (model, h, layer index) -> keyword arguments of that layer


def _positions(h):
    return torch.arange(h.shape[1], device=h.device).unsqueeze(0)


def _decoder_mask(model, h, index):
    """The mask the model's own forward builds for layer `index` (sdpa on full batches: None, it runs causal)."""
    from transformers import masking_utils

    config = model.config
    types = getattr(config, "layer_types", None)
    sliding = types[index] == "sliding_attention" if types else getattr(config, "sliding_window", None) is not None
    make = masking_utils.create_sliding_window_causal_mask if sliding else masking_utils.create_causal_mask
    return make(config=config, inputs_embeds=h, attention_mask=None, cache=None)  # (no packed sequences to find)


def _gpt2_embed(model, x):
    t = model.transformer
    return t.drop(t.wte(x) + t.wpe(_positions(x)))


def _llama_inputs(model, h, index, rotary):
    positions = _positions(h)
    return {
        "position_ids": positions,
        "position_embeddings": rotary(h, positions),
        "attention_mask": _decoder_mask(model, h, index),
    }


def _bert_mask(model, h, index):
    from transformers import masking_utils

    return {
        "attention_mask": masking_utils.create_bidirectional_mask(
            config=model.config, inputs_embeds=h, attention_mask=None
        )
    }


def _bert_head(model):
    return model.cls if hasattr(model, "cls") else model.lm_head


FAMILIES = {
    "gpt2": Family(
        "gpt2",
        lambda m: "transformer.h",
        _gpt2_embed,
        lambda m, h: m.lm_head(m.transformer.ln_f(h)),
        lambda m, h, i: {"attention_mask": _decoder_mask(m, h, i), "position_ids": _positions(h)},
    ),
    **{
        t: Family(
            "llama-like",
            lambda m: "model.layers",
            lambda m, x: m.model.embed_tokens(x),
            lambda m, h: m.lm_head(m.model.norm(h)),
        )
        for t in LLAMA_LIKE
    },
    **{
        t: Family(
            "bert-like",
            lambda m: f"{m.base_model_prefix}.encoder.layer",
            lambda m, x: m.base_model.embeddings(input_ids=x),
            lambda m, h: _bert_head(m)(h),
            _bert_mask,
        )
        for t in ("bert", "roberta")
    },
    "vit": Family(
        "vit",
        lambda m: "vit.layers",
        lambda m, x: m.vit.embeddings(x),
        lambda m, h: m.classifier(m.vit.layernorm(h)[:, 0, :]),
    ),
}


def family_of(model: nn.Module) -> Family:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(
            f"pipeline parallelism splits Hugging Face models of the families {sorted(FAMILIES)}; this "
            f"{type(model).__name__} is {model_type!r}. Give it embed, head_loss and hidden_shape (a "
            f"short adapter: toolkit/models/hf_pipeline.py shows one), or use tp= or a data-parallel "
            f"strategy."
        )
    return FAMILIES[model_type]


def pipelined(model: nn.Module) -> nn.Module:
    """`model` with the three parts a pipeline needs, in place (unchanged if it has them); returns it."""
    if all(callable(getattr(model, name, None)) for name in PROTOCOL):
        return model
    family = family_of(model)
    convention = recognise(model)
    if getattr(model.config, "output_router_logits", False):
        raise ValueError(
            f"{type(model).__name__} adds its routers' load-balancing loss (output_router_logits=True), "
            f"computed over every layer's router at once; under pipeline parallelism the layers run on "
            f"different ranks. Set config.output_router_logits=False for pp, or use a data-parallel "
            f"strategy (the loss then is the model's own)."
        )
    layers = model.get_submodule(family.layers(model))
    inputs = family.layer_inputs
    if family.name == "llama-like":
        rotary = model.model.rotary_emb  # parameter-free: every stage computes its layers' (cos, sin) with it
        inputs = lambda m, h, i: _llama_inputs(m, h, i, rotary)  # noqa: E731
    if inputs is not None:
        for index, layer in enumerate(layers):
            layer.register_forward_pre_hook(_LayerInputs(model, inputs, index), with_kwargs=True)
    model._pipeline_family, model._pipeline_convention = family, convention
    model._pipeline_of = type(model).__name__
    model.__class__ = type(f"Pipelined{type(model).__name__}", (PipelineParts, type(model)), {})
    return model


_announced = [None]  # the split printed last (a simulation wraps each kind of stage: said once)


def announce(model: nn.Module, split) -> None:
    """Print where a Hugging Face model's parts go (before anything runs), unless it was the split printed last."""
    if not isinstance(model, PipelineParts):
        return
    import torch.distributed as dist

    def layers(keys):
        return f"{split.container}.{keys[0]}" + (f"..{keys[-1]}" if len(keys) > 1 else "")

    last = len(split.stages) - 1
    stages = [
        f"stage {s}: "
        + " + ".join(
            (["embedding"] if s == 0 else []) + [layers(keys)] + (["final norm, head and loss"] if s == last else [])
        )
        for s, keys in enumerate(split.stages)
    ]
    key = (model._pipeline_of, tuple(split.stages))
    if key != _announced[0] and (not dist.is_initialized() or dist.get_rank() == 0):
        _announced[0] = key
        print(
            f"pipeline split of {model._pipeline_of} ({model._pipeline_family.name}, "
            f"{sum(map(len, split.stages))} layers over {len(split.stages)} stages): " + " | ".join(stages)
        )


class _LayerInputs:
    """A forward pre-hook: what the layer's model would pass it beside h, added when it is called as layer(h)."""

    def __init__(self, model, inputs, index):
        self.config_holder, self.inputs, self.index = _ConfigOnly(model), inputs, index

    def __call__(self, module, args, kwargs):
        if kwargs or len(args) != 1:  # called by the model's own forward: it passed them
            return None
        return args, self.inputs(self.config_holder, args[0], self.index)


class _ConfigOnly:
    """What the layer inputs read of the model: its config (no reference to its modules, which stages drop)."""

    def __init__(self, model):
        self.config = model.config


class PipelineParts:
    """Mixed into a Hugging Face model's class by `pipelined`: embed, head_loss and hidden_shape."""

    def embed(self, x):
        return self._pipeline_family.embed(self, x)

    def head_loss(self, h, y):
        logits = self._pipeline_family.head(self, h)
        if y is None:
            return logits
        kind = self._pipeline_convention.name
        if kind == "causal-lm":
            return self.loss_function(logits=logits, labels=y, vocab_size=self.config.vocab_size, shift_labels=y)
        if kind == "masked-lm":
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        if kind == "image-classification":
            return self.loss_function(y, logits, self.config)
        raise ValueError(
            f"pipeline parallelism: no loss for a {type(self).__name__} called by the {kind!r} convention."
        )

    def hidden_shape(self, x_shape) -> tuple:
        c = self.config
        if self._pipeline_convention.name == "image-classification":
            return (x_shape[0], (c.image_size // c.patch_size) ** 2 + 1, c.hidden_size)
        return (x_shape[0], x_shape[1], c.hidden_size)


def is_hf(model: nn.Module) -> bool:
    """A Hugging Face model: its config says its model_type."""
    return isinstance(getattr(getattr(model, "config", None), "model_type", None), str)
