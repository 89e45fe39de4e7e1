"""The model protocol: how the toolkit feeds any model a batch and gets its training loss back.

Every door that runs a model asks it one thing: here is a batch (inputs, targets), what is the loss?
`toolkit.train`, the simulator (`toolkit.sim.simulate`), the pipeline (`toolkit.parallel.pipeline`, which also
needs the model cut in three: `hf_pipeline.py`) and the command line all ask it through one `Convention`,
recognised from the model before it is wrapped:

    convention = recognise(model)                         # or recognise(model, loss_fn=..., batch_fn=...)
    data = convention.data(model, vocab_size=64, seq_len=32, seed=0)
    inputs, targets = data.batch(step, global_batch_size, rank=r, world_size=n, device=device)
    loss = convention.loss(wrapped_model, inputs, targets)

The conventions recognised, from the model's forward and (for Hugging Face models) its task:

    "toolkit"               forward(x, y) -> scalar loss: the toolkit GPT, or any model written that way;
                            trained on the token corpus (`corpus.py`, y = x shifted by one)
    "causal-lm"             forward(input_ids=, labels=) -> output with .loss: a Hugging Face *ForCausalLM (GPT-2,
                            Llama, Mixtral, Qwen-MoE, ...), called model(input_ids=x, labels=y, shift_labels=y): the
                            corpus's y is already the next token, which `shift_labels` tells the model's own loss
                            function, so every position is scored as the toolkit GPT scores it
    "masked-lm"             the same forward, a *ForMaskedLM (BERT, RoBERTa, ...): the corpus with MASK_FRACTION of
                            every row's positions masked (the same count in every row, so each rank's mean loss
                            weighs as many tokens and data parallelism averages exactly); labels -100 elsewhere
    "image-classification"  forward(pixel_values=, labels=) -> .loss: a *ForImageClassification (ViT, ...), trained on
                            synthetic images (`images.py`) sized by the model's config

Anything else: pass `loss_fn(model, inputs, targets) -> scalar loss` and/or `batch_fn(step, global_batch_size,
*, rank, world_size, device) -> (inputs, targets)`; either one alone replaces only its half.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .corpus import SyntheticCorpus, _check_rank, _generator
from .images import SyntheticImages

MASK_FRACTION = 0.15  # BERT's share of masked positions
IGNORE = -100  # the label Hugging Face's losses skip


@dataclass(frozen=True)
class Convention:
    """How to call one model: its `loss(model, inputs, targets)`, and the data it trains on."""

    name: str
    loss: Callable
    make_data: Callable  # (model, vocab_size, seq_len, seed) -> a source with batch() and example()
    why: str  # one sentence: how it was recognised (it goes into the Run)

    def data(self, model, *, vocab_size: int = 64, seq_len: int = 32, seed: int = 0):
        return self.make_data(model, vocab_size, seq_len, seed)


# --- the losses ----------------------------------------------------------------------------------------------------
def toolkit_loss(model, x, y):
    return model(x, y)


def causal_lm_loss(model, x, y):
    return _loss_of(model(input_ids=x, labels=y, shift_labels=y), model)


def masked_lm_loss(model, x, y):
    return _loss_of(model(input_ids=x, labels=y), model)


def image_loss(model, pixels, labels):
    return _loss_of(model(pixel_values=pixels, labels=labels), model)


def _loss_of(output, model):
    loss = getattr(output, "loss", None)
    if loss is None:
        raise ValueError(
            f"{type(model).__name__} was given labels but returned no .loss: it does not compute its own "
            f"loss. Pass loss_fn(model, inputs, targets) -> scalar loss."
        )
    return loss


# --- the data ------------------------------------------------------------------------------------------------------
class Tokens:
    """The token corpus, as `(x, y)`: y the next tokens (causal and toolkit models)."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.corpus = SyntheticCorpus(vocab_size, seq_len, seed)

    def batch(self, step, global_batch_size, *, rank=0, world_size=1, device=None):
        return self.corpus.batch(step, global_batch_size, rank=rank, world_size=world_size, device=device)

    def example(self, batch_size: int, seq_len: int, device="meta"):
        x = torch.empty((batch_size, seq_len), dtype=torch.long, device=device)
        return x, torch.empty_like(x)


class MaskedTokens(Tokens):
    """The token corpus with `MASK_FRACTION` of every row's positions replaced by `mask_id`; the labels are the
    original tokens there and `IGNORE` elsewhere. Which positions: a pure function of (seed, step, batch size)."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int, mask_id: int):
        super().__init__(vocab_size, seq_len, seed)
        self.mask_id, self.seed = mask_id, seed
        self.per_row = max(1, round(MASK_FRACTION * seq_len))

    def batch(self, step, global_batch_size, *, rank=0, world_size=1, device=None):
        _check_rank(rank, world_size, global_batch_size)
        x, _ = self.corpus.batch(step, global_batch_size)
        g = _generator("mask", self.seed, step, global_batch_size)
        where = torch.rand(x.shape, generator=g).argsort(dim=1)[:, : self.per_row]  # per_row positions per row
        inputs, labels = x.clone(), torch.full_like(x, IGNORE)
        labels.scatter_(1, where, x.gather(1, where))
        inputs.scatter_(1, where, self.mask_id)
        b = global_batch_size // world_size
        inputs, labels = inputs[rank * b : (rank + 1) * b], labels[rank * b : (rank + 1) * b]
        return (inputs, labels) if device is None else (inputs.to(device), labels.to(device))


class Images(SyntheticImages):
    def example(self, batch_size: int, seq_len: int, device="meta", dtype=torch.float32):
        shape = (batch_size, self.channels, self.image_size, self.image_size)
        return (
            torch.empty(shape, dtype=dtype, device=device),
            torch.empty((batch_size,), dtype=torch.long, device=device),
        )


class Custom:
    """A user's `batch_fn(step, global_batch_size, *, rank, world_size, device) -> (inputs, targets)`."""

    def __init__(self, batch_fn):
        self.batch_fn = batch_fn

    def batch(self, step, global_batch_size, *, rank=0, world_size=1, device=None):
        return self.batch_fn(step, global_batch_size, rank=rank, world_size=world_size, device=device)

    def example(self, batch_size: int, seq_len: int, device="meta"):
        inputs, targets = self.batch_fn(0, batch_size, rank=0, world_size=1, device=None)
        return _like(inputs, device), _like(targets, device)


def _like(t, device):
    return torch.empty(t.shape, dtype=t.dtype, device=device) if torch.is_tensor(t) else t


def _tokens(model, vocab_size, seq_len, seed):
    _check_fits(model, vocab_size, seq_len)
    return Tokens(vocab_size, seq_len, seed)


def _masked(model, vocab_size, seq_len, seed):
    _check_fits(model, vocab_size, seq_len)
    config = model.config
    mask_id = getattr(config, "mask_token_id", None)
    return MaskedTokens(vocab_size, seq_len, seed, config.vocab_size - 1 if mask_id is None else mask_id)


def _images(model, vocab_size, seq_len, seed):
    c = model.config
    return Images(c.num_labels, c.image_size, getattr(c, "num_channels", 3), seed)


def _check_fits(model, vocab_size: int, seq_len: int) -> None:
    """The corpus's tokens must be ids of the model's vocabulary, and its sequences no longer than its positions."""
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and vocab_size > vocab:
        raise ValueError(
            f"the token corpus has vocab_size={vocab_size} but {type(model).__name__}'s vocabulary has "
            f"{vocab} ids: use a corpus vocab_size <= {vocab} (TrainConfig.vocab_size)."
        )
    positions = max_positions(model)
    if positions is not None and seq_len > positions:
        raise ValueError(
            f"sequences of seq_len={seq_len} tokens are longer than {type(model).__name__}'s "
            f"{positions} positions: use seq_len <= {positions} (TrainConfig.seq_len)."
        )


def max_positions(model):
    """The longest sequence a model takes (its config's), or None if it does not say."""
    config = getattr(model, "config", None)
    for name in ("seq_len", "max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


# --- recognising a model -------------------------------------------------------------------------------------------
KINDS = {
    "causal-lm": (causal_lm_loss, _tokens, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", ("ForCausalLM", "LMHeadModel")),
    "masked-lm": (masked_lm_loss, _masked, "MODEL_FOR_MASKED_LM_MAPPING_NAMES", ("ForMaskedLM",)),
    "image-classification": (
        image_loss,
        _images,
        "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
        ("ForImageClassification",),
    ),
}


def recognise(model: torch.nn.Module, *, loss_fn=None, batch_fn=None) -> Convention:
    """The convention `model` is called by; `loss_fn` / `batch_fn` replace its loss / its data."""
    for name, fn in (("loss_fn", loss_fn), ("batch_fn", batch_fn)):
        if fn is not None and not callable(fn):
            raise ValueError(f"{name} must be a function, got {fn!r}.")
    found = _recognise(model, must=loss_fn is None)
    if loss_fn is None and batch_fn is None:
        return found
    return Convention(
        "custom",
        loss_fn or found.loss,
        (lambda *args: Custom(batch_fn)) if batch_fn is not None else found.make_data,
        f"given: {'loss_fn' if loss_fn else found.name + ' loss'} and "
        f"{'batch_fn' if batch_fn else found.name + ' data'}",
    )


def _recognise(model, must: bool) -> Convention:
    params = _forward_params(model)
    cls = type(model).__name__
    if "pixel_values" in params and "labels" in params:
        return _kind("image-classification", f"{cls}.forward takes pixel_values and labels")
    if "input_ids" in params and "labels" in params:
        kind = _task_of(model)
        if kind in ("causal-lm", "masked-lm"):
            return _kind(kind, f"{cls}.forward takes input_ids and labels; {cls} is a {kind.replace('-', ' ')}")
        if must:
            raise ValueError(
                f"{cls} takes input_ids and labels, but it is neither a causal nor a masked language "
                f"model, the two kinds the toolkit knows how to feed (its task's labels are not next or "
                f"masked tokens). Pass loss_fn(model, inputs, targets) and batch_fn(step, "
                f"global_batch_size, *, rank, world_size, device) for it."
            )
        return Convention("unknown", toolkit_loss, _tokens, f"{cls}: a loss_fn is given")
    return Convention("toolkit", toolkit_loss, _tokens, f"{cls}.forward is called model(x, y) -> loss")


def _kind(name: str, why: str) -> Convention:
    loss, data, _, _ = KINDS[name]
    return Convention(name, loss, data, why)


def _forward_params(model) -> set:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _task_of(model) -> str | None:
    """ "causal-lm" or "masked-lm" from Hugging Face's own task tables (the Auto classes' mappings), else from the
    class's name (a model written outside transformers in its style)."""
    names = {type(model).__name__, *(c.__name__ for c in type(model).__mro__)}
    tables = {}
    if any(c.__module__.startswith("transformers.") for c in type(model).__mro__):
        from transformers.models.auto import modeling_auto

        tables = {kind: getattr(modeling_auto, table, {}) for kind, (_, _, table, _) in KINDS.items()}
    for kind, table in tables.items():
        known = {n for value in table.values() for n in ((value,) if isinstance(value, str) else value)}
        if names & known:
            return kind
    for kind, (_, _, _, suffixes) in KINDS.items():
        if type(model).__name__.endswith(suffixes):
            return kind
    return None


def sequence_length(model, convention: Convention):
    """Tokens per example the model computes on: its context for a language model, its patches (and the class
    token) for a vision transformer; None when the model does not say."""
    config = getattr(model, "config", None)
    if convention.name == "image-classification":
        size, patch = getattr(config, "image_size", None), getattr(config, "patch_size", None)
        return (size // patch) ** 2 + 1 if isinstance(size, int) and isinstance(patch, int) else 1
    return max_positions(model)
