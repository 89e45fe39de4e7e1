"""Step 2 of a simulation: any model built on the meta device, and the batch it is fed, as shapes.

    model, convention = build(model_fn)                  # the toolkit GPT, a Hugging Face model as it comes, ...
    x, y = example_batch(model, convention, batch_per_rank, seq_len)

What a model needs to be built without memory or values (the flow torch's and torchtitan's meta initialization
follow: build on meta, materialize later):

- parameters and buffers: every tensor is created under `torch.device("meta")`, buffers included (Llama's rotary
  `inv_freq`, BERT's `position_ids`); nothing reads a value while building. A strategy that materializes the
  model (FSDP's deferred init, `parallel/fsdp_init.py`) gives buffers their values with the model's own init;
  here there are none to give (`no_values`).
- dtypes: as the model declares them (whatever dtype its parameters were built in is the one simulated).
- data-dependent routing: a Hugging Face mixture of experts chooses experts from the values of its router's
  scores, and runs each expert on the rows that chose it (`nonzero`, `.item()`): meta tensors have no values.
  Its experts module runs the toolkit's layer instead, every expert on this rank as the model came
  (`toolkit.moe.hf.expert_parallel(local=True)`), on the assumed routing (`routing=`, balanced by default): each
  expert's rows, hence its GEMMs, priced from the shapes. A model made expert-parallel in `model_fn` keeps its
  layout.
"""

from __future__ import annotations

import sys

import torch

from ..models.protocol import Convention, recognise, sequence_length
from ..moe.hf import ExpertParallelExperts, expert_parallel, find_experts


def build(model_fn, *, loss_fn=None, batch_fn=None) -> tuple[torch.nn.Module, Convention]:
    """(the model on meta, ready to simulate; how it is called)."""
    model = build_on_meta(model_fn)
    convention = recognise(model, loss_fn=loss_fn, batch_fn=batch_fn)  # the model as it came, before any change
    as_it_came = [name for name, m in find_experts(model) if not isinstance(m, ExpertParallelExperts)]
    if as_it_came:
        expert_parallel(model, local=True)
    return model, convention


def build_on_meta(model_fn) -> torch.nn.Module:
    """`model_fn()` under `torch.device("meta")`; a clear error when it cannot be built there."""
    try:
        with torch.device("meta"):
            model = model_fn()
    except Exception as exc:  # noqa: BLE001 - say which module failed, and why
        where = _failing_module(sys.exc_info()[2])
        raise ValueError(
            f"model_fn() could not build the model on the meta device (shapes only, no values): {where}raised "
            f"{type(exc).__name__}: {exc}. Build every tensor without an explicit device= (the simulator builds "
            f"under `with torch.device('meta')`) and do not read tensor values (.item(), .tolist(), printing) "
            f"while building."
        ) from exc
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model_fn() must return an nn.Module, got {type(model).__name__}.")
    real = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if not t.is_meta]
    if real:
        raise ValueError(
            f"model_fn() built tensors on a real device, not on meta: {real[:4]}. Create them without "
            f"an explicit device= so that the simulator can build them on the meta device."
        )
    return model


def _failing_module(tb) -> str:
    """'Module (class X) ' for the innermost nn.Module whose code was running when building failed."""
    found = ""
    while tb is not None:
        this = tb.tb_frame.f_locals.get("self")
        if isinstance(this, torch.nn.Module):
            found = f"{type(this).__name__} (in {tb.tb_frame.f_code.co_name}) "
        tb = tb.tb_next
    return found


def no_values(name, module) -> None:
    """FSDP's `param_init_fn` on the simulated cluster: meta parameters and buffers have no values to fill."""


def seq_len_of(model, convention: Convention, seq_len):
    """The tokens per sequence: `seq_len` if given, else the model's (its context, or an image's patches)."""
    if seq_len is not None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}.")
        return seq_len
    found = sequence_length(model, convention)
    if found is None:
        raise ValueError(
            f"seq_len=None needs a model that says its sequence length (config.seq_len, "
            f"max_position_embeddings or n_positions, as toolkit and Hugging Face models do); this "
            f"{type(model).__name__} does not: pass seq_len=."
        )
    return found


def example_batch(model, convention: Convention, batch_per_rank: int, seq_len: int):
    """(inputs, targets) of one rank's batch as meta tensors: the shapes and dtypes its data has."""
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", 64)
    data = convention.data(model, vocab_size=min(64, vocab) if isinstance(vocab, int) else 64, seq_len=seq_len)
    return data.example(batch_per_rank, seq_len, device="meta")


def count_params(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters of the whole model, of which in MoE experts): a rank holds E_local of E experts, or
    with more ranks than experts one slice of one, so every expert is counted from its shape (d_model ->
    d_ff -> d_model, with biases), once."""
    from ..moe.experts import Experts, is_expert

    mine, experts = set(), 0
    for m in model.modules():
        if isinstance(m, Experts):
            mine.update(id(p) for p in m.parameters(recurse=False))
            experts += m.num_experts * (2 * m.d_model * m.d_ff + m.d_ff + m.d_model)
        elif any(is_expert(p) for p in m.parameters(recurse=False)):  # another layout's experts (moe/hf.py)
            mine.update(id(p) for p in m.parameters(recurse=False))
            experts += m.all_expert_params
    return sum(p.numel() for p in model.parameters() if id(p) not in mine) + experts, experts
