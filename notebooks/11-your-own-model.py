# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation.jupytext_version,-jupytext.text_representation.format_version
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 11 · Bring your own model: a Hugging Face Llama through FSDP, tensor and pipeline parallelism, and at 512 GPUs
#
# Every lesson so far trained the toolkit's own tiny GPT. The models people bring come from elsewhere, most
# often from Hugging Face `transformers`, and they are called differently: `model(input_ids=..., labels=...)`
# returns an output object whose `.loss` is the loss; a masked LM wants masked tokens, an image classifier
# pixels. Nothing below writes an adapter. The toolkit reads how a model is called from the model itself
# (`toolkit/models/protocol.py`), and every door uses that one answer: `toolkit.train`, the pipeline, the
# simulator, the command line. The plan:
#
# 1. **the model as it comes**: a Llama built from a config (random weights, nothing downloaded), and what the
#    toolkit recognises in it;
# 2. **FSDP, tensor and pipeline parallelism on 2 ranks**: each trains the model exactly as one process does;
#    FSDP's units, memory through a step, the tensor-parallel timeline (the model's own plan) and the pipeline's
#    (the split found automatically) drawn;
# 3. **the same architecture at Llama 2 7B's size on 512 simulated GPUs**: memory, whether it fits, step time.
#
# It runs top to bottom in about a minute on a 2-core laptop.

# %%
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import toolkit
from toolkit.models.protocol import recognise
from toolkit.parallel.pipeline import bubble
from toolkit.run import Run
from toolkit.sim import simulate

CONFIG = LlamaConfig(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)


def llama(config=None):
    """The model as a user would build it (seeded, so every rank builds the same one)."""
    torch.manual_seed(0)
    return LlamaForCausalLM(CONFIG)


# %% [markdown]
# ## 1. The model as it comes
#
# `LlamaForCausalLM` takes `input_ids` and `labels` and returns an output with `.loss`. The toolkit's corpus
# gives batches `(x, y)` where y is already x shifted by one token; Hugging Face shifts its labels itself, so
# the toolkit calls `model(input_ids=x, labels=y, shift_labels=y)`, which tells the model's own loss function
# that the targets are aligned. The same model has a rotary position embedding whose `inv_freq` is a buffer,
# computed from the config: it matters below, when the model is built on the meta device.

# %%
model = llama()
convention = recognise(model)
PARAMS = sum(p.numel() for p in model.parameters())
print(
    f"{type(model).__name__}: {PARAMS:,} parameters; called by the {convention.name!r} convention "
    f"({convention.why}); buffers: {[n for n, _ in model.named_buffers()]}"
)
assert convention.name == "causal-lm" and PARAMS == 156_224

# %% [markdown]
# 156,224 parameters, four decoder layers. Small enough for two CPU ranks; the same code trains it on GPUs.

# %% [markdown]
# ## 2. Three ways to split it over 2 ranks, each held to one process
#
# Each layout below is `toolkit.train.train(config, model_fn=llama)`, the loop every lesson used, with only
# the strategy's options changed:
#
# - **FSDP** (lesson 04): the default wrap policy finds the model's repeated layers, whatever its class;
# - **tensor parallelism** `tp=2`: no plan given, so the model's own is used (transformers declares one per
#   model: q, k, v, gate and up projections column-parallel, o and down row-parallel, the embedding and the head
#   split by vocabulary);
# - **pipeline parallelism** `pp=2`: the toolkit recognises a Llama and cuts it where the pipeline needs it:
#   the embedding, the decoder layers (each given its rotary embedding and causal mask, which the model's
#   forward would have computed for it) and the final norm, head and loss.
#
# The reference is one process training the same model on the whole batch, with plain SGD so that the comparison
# sees the gradients themselves (Adam divides each update by the gradient's running size, which magnifies
# rounding where a gradient is near zero). One launch of 2 ranks runs all three layouts.

# %%
STEPS = 3
TRAINING = dict(steps=STEPS, global_batch_size=8, optimizer="sgd", lr=0.1, progress=False)
LAYOUTS = {"fsdp": ("fsdp", {}), "tp": ("local", {"tp": 2}), "pp": ("local", {"pp": 2, "microbatches": 4})}


def train_layouts():
    from toolkit.train import TrainConfig, train

    out = {}
    for label, (strategy, options) in LAYOUTS.items():
        config = TrainConfig(strategy=strategy, options=options, **TRAINING)
        out[label] = train(config, model_fn=llama, return_state=True)
    return out


reference_run, reference = toolkit.train.train(toolkit.train.TrainConfig(**TRAINING), model_fn=llama, return_state=True)
per_rank = toolkit.launch(train_layouts, 2)
RUNS = {label: Run.merge(ranks[label][0] for ranks in per_rank) for label in LAYOUTS}
DIFFS = {
    label: max((per_rank[0][label][1][n] - v).abs().max().item() for n, v in reference.items()) for label in LAYOUTS
}
for label, diff in DIFFS.items():
    print(
        f"{label:4s}: final loss {RUNS[label].metric('loss')[-1][1]:.4f} (one process: "
        f"{reference_run.metric('loss')[-1][1]:.4f}), largest weight difference {diff:.1e}"
    )
assert max(DIFFS.values()) < 1e-5

# %% [markdown]
# All three layouts end where one process ends: every weight within 1e-5 of the one-process run (fp32; only the
# order of the sums differs). What each did is in its Run.

# %% [markdown]
# ### FSDP: the units it chose, and memory through a step
#
# FSDP's default policy made one unit per decoder layer, the FSDP paper's recipe for a transformer, and the
# root unit for the rest (the embedding, the final norm and the head). Between uses a rank keeps half of every
# unit: its fp32 parameters and gradients are half of one process's, as lesson 04's formula says (plain SGD
# keeps no optimizer state).

# %%
policy = RUNS["fsdp"].metric("fsdp/wrap_policy")[0][1]
print(policy)
assert "model.layers (4 x LlamaDecoderLayer)" in policy
last_step = [x for x in RUNS["fsdp"].samples if x["rank"] == 0 and x["step"] == STEPS - 1]
kept = {k: min(x[k] for x in last_step) for k in ("params",)} | {"grads": max(x["grads"] for x in last_step)}
formula = toolkit.memory.model_states_breakdown(PARAMS, 2, 3, param_bytes=4, grad_bytes=4, optimizer_multiplier=0)
for k, v in kept.items():
    print(
        f"{k}: {v / 1e3:.1f} kB per rank measured, {formula[k] / 1e3:.1f} kB by the formula (one process: "
        f"{4 * PARAMS / 1e3:.1f} kB)"
    )
    assert abs(v - formula[k]) / formula[k] < 0.01  # flat buffers pad each unit to a multiple of 2
toolkit.viz.memory_over_time(RUNS["fsdp"], rank=0, step=STEPS - 1).show()

# %% [markdown]
# ### Tensor parallelism: the model's own plan, and the timeline
#
# Each decoder layer has two row-parallel layers (o_proj and down_proj): each adds its ranks' partial sums
# with one all-reduce in forward (Megatron's g), and the column-parallel layers before them one in backward
# (f). The timeline of the last step shows them, on the critical path (nothing computes while they run).

# %%
tp_run = RUNS["tp"]
forward = next(
    e
    for e in tp_run.events
    if e["rank"] == 0 and e["name"] == "forward" and e["cat"] == "compute" and e["args"]["step"] == STEPS - 1
)
last = [e for e in tp_run.comm_events(0, "all_reduce") if forward["start"] <= e["start"] <= forward["end"]]
print(f"all-reduces in one forward on rank 0: {len(last)}")
assert len(last) == 2 * CONFIG.num_hidden_layers + 1  # g after o_proj and down_proj per layer, + the vocabulary's
toolkit.viz.timeline(tp_run, where=lambda e: e["start"] >= forward["start"]).show()

# %% [markdown]
# Nine all-reduces per forward: two per layer (g after o_proj and after down_proj) and one after the
# vocabulary-parallel embedding. The head's logits are gathered for the model's own loss (the plan's
# `colwise_gather_output`).

# %% [markdown]
# ### Pipeline parallelism: the split, and the schedule
#
# The split printed above (the launch's output) put the embedding and layers 0-1 on rank 0, layers 2-3 with the
# final norm, head and loss on rank 1. Below, the last step's 1F1B schedule: 4 micro-batches through 2 stages.
# The formula's bubble, (p-1)/(m+p-1) = 20%, counts only the schedule's idle time; a CPU run adds its sends,
# receives and Python between actions, which lesson 09 separates from it.

# %%
pp_run = RUNS["pp"]
stages = {
    r: sorted({e["args"]["stage"] for e in pp_run.events if e["rank"] == r and "action" in e["args"]})
    for r in pp_run.ranks
}
print(
    f"stages each rank ran: {stages}; bubble measured: "
    f"{', '.join(f'rank {r} {b:.0%}' for r, b in bubble.measured_bubble(pp_run).items())}; "
    f"the formula's {bubble.formula_bubble('1f1b', 2, 4):.0%}"
)
assert stages == {0: [0], 1: [1]} and bubble.formula_bubble("1f1b", 2, 4) == 0.2
toolkit.viz.pipeline_timeline(pp_run, formula=bubble.formula_bubble("1f1b", 2, 4)).show()

# %% [markdown]
# ## 3. The same architecture at Llama 2 7B's size, on 512 simulated GPUs
#
# The simulator (lesson 07) builds the model on the meta device: shapes and dtypes, no memory, buffers
# included (the rotary `inv_freq` is made on meta too, and FSDP's deferred initialization gives it its value
# with the model's own init on a real rank). The config below is Llama 2 7B's (Touvron et al. 2023): 32
# layers of width 4,096, 32 heads, an MLP of 11,008, a vocabulary of 32,000, sequences of 4,096 tokens.
# FSDP over 512 A100s, bf16 mixed precision, one sequence per GPU.

# %%
LLAMA_2_7B = LlamaConfig(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    max_position_embeddings=4096,
)
SIM = simulate(
    lambda: LlamaForCausalLM(LLAMA_2_7B),
    "fsdp",
    512,
    batch_per_rank=1,
    cluster="dgx-a100",
    mixed_precision=True,
    progress=False,
)
print(SIM.summary())
acts = SIM.peak_memory["activations"]
states = SIM.theory()["model_states_total"]
print(
    f"{SIM.num_params / 1e9:.2f}B parameters; model states {states / 1e6:.0f} MB per GPU by the formula; peak "
    f"{SIM.peak / 1e9:.1f} GB, of which activations {acts / 1e9:.1f} GB"
)
assert SIM.num_params == 6_738_415_616 and SIM.fits and SIM.step_time > 0
kept = sum(SIM.memory[k] for k in ("params", "grads", "optimizer"))
assert abs(kept - states) / states < 0.01 and round(states / 1e6) == 211
assert 25e9 < SIM.peak < 30e9 and acts / SIM.peak > 0.9
toolkit.viz.peak_bars(
    {"fsdp, 512 x A100": SIM.peak_memory},
    capacity=SIM.fit.capacity,
    device="A100 80GB",
    predicted={"fsdp, 512 x A100": states},
).show()

# %% [markdown]
# 6.74B parameters, Hugging Face's count for Llama 2 7B. Sharded 512 ways, its model states are about 211 MB per
# GPU, the formula's; the peak, about 27 GB, is mostly the activations of one 4,096-token sequence through 32
# layers: the model fits an 80 GB A100 without recomputation. The summary above also prices the step on the
# cluster (time, MFU): lesson 07 says how, and how far to trust it.
#
# **Further.** A masked LM (`BertForMaskedLM`) and an image classifier (`ViTForImageClassification`) go through
# the same doors, fed masked tokens and synthetic images; a mixture of experts (Mixtral, Qwen2-MoE) gets expert
# parallelism with its own gate kept: `toolkit.moe.hf.expert_parallel(model)`, whose load the heatmap of lesson
# 05 draws. A model the toolkit does not recognise takes `loss_fn=` and `batch_fn=`; a family it cannot split for
# a pipeline takes three short methods (`toolkit/models/hf_pipeline.py` shows them). From the command line:
# `.venv/bin/python -m toolkit simulate --model path/to/config.json`. What differs from transformers' own ways:
# docs/differences.md.
