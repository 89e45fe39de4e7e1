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
# # 03 · ZeRO: data parallelism without the redundancy
#
# Data parallelism (notebook 02) scales the *batch*: every rank holds a full copy of the model and
# its training state, and the ranks only exchange gradients. That copy is the problem. Training a
# model needs far more memory than its parameters alone, and plain data parallelism pays that full
# price on every rank, N times over.
#
# ZeRO (Zero Redundancy Optimizer, Rajbhandari et al., 2020) keeps data parallelism's simple
# programming model but stops replicating the training state: each of the N ranks keeps only a
# 1/N slice of it, and collectives bring back whatever a rank needs at the moment it needs it.
# It comes in three stages, each partitioning one more kind of state.
#
# This notebook:
#
# 1. counts what lives in memory during training: the (2 + 2 + K)Ψ accounting;
# 2. writes down what each ZeRO stage saves, on paper;
# 3. trains the tiny GPT with DDP and ZeRO 1, 2, 3 on real ranks (fp32 and mixed precision);
# 4. follows one training step per stage: which collective runs when, from the traces;
# 5. puts the measured memory per rank next to the formula;
# 6. measures the bytes each rank sends per step against 2Ψ(N-1)/N and 3Ψ(N-1)/N;
# 7. contrasts ZeRO-1 with a reduce-scatter and with an all-reduce;
# 8. leaves you an interactive memory explorer that reproduces the ZeRO paper's Figure 1.
#
# It runs top to bottom in about a minute on a 2-core laptop.

# %%
import statistics

from IPython.display import HTML, display

import toolkit
from toolkit import viz
from toolkit.compare_theory import MODEL, predicted_model_states
from toolkit.memory import communication_per_step, model_states, model_states_breakdown
from toolkit.models import tiny_gpt
from toolkit.run import Run
from toolkit.trace.analysis import bytes_per_step, step_windows
from toolkit.train import TrainConfig
from toolkit.viz.memory import comm_bars, memory_bars, model_states_bars, peak_by_category

WORLD = 2  # ranks per strategy; 2 processes share a 2-core laptop comfortably
STEPS = 3  # enough for a steady step to look at; the losses are checked, not the convergence
GB, MB, KB = 1e9, 1e6, 1e3


def show_table(rows):
    """A list of dicts as an HTML table under the cell."""
    display(HTML(viz.table(rows)))


# %% [markdown]
# ## 1. What lives in memory during training
#
# Four kinds of tensors fill a GPU while a model trains:
#
# - **parameters**, the weights the forward pass computes with;
# - **gradients**, one per parameter, produced by the backward pass;
# - **optimizer states**, whatever the optimizer remembers between steps (Adam: a momentum and a
#   variance per parameter);
# - **activations**, the intermediate results of the forward pass that the backward pass needs.
#
# The first three are the **model states**: their size depends only on the number of parameters Ψ,
# not on the batch. With mixed-precision Adam, the standard recipe for large models, each parameter
# costs:
#
# | what | precision | bytes per parameter |
# | --- | --- | --- |
# | parameter used in forward and backward | fp16 / bf16 | 2 |
# | gradient | fp16 / bf16 | 2 |
# | fp32 master copy of the parameter (the optimizer updates this one) | fp32 | 4 |
# | Adam momentum | fp32 | 4 |
# | Adam variance | fp32 | 4 |
#
# The ZeRO paper writes the optimizer's share as K bytes per parameter, here K = 4 + 4 + 4 = 12, so
# the model states take **(2 + 2 + K)Ψ = 16Ψ bytes**. Some lectures count K = 16: they add an fp32
# copy of the gradients, which many implementations keep for the update, and reach 20 bytes per
# parameter, so a 1B-parameter model needs 20 GB per GPU before a single activation is stored.
# (Pure fp32 training with Adam has no separate master copy: 4 + 4 + 8 = 16 bytes too.)
#
# `toolkit.memory.model_states` is this formula. What it says for a few well-known sizes, per GPU
# under plain data parallelism:

# %%
examples = [
    ("1B parameters, K = 12", 1e9, 12),
    ("1B parameters, K = 16", 1e9, 16),
    ("7.5B (the ZeRO paper's example), K = 12", 7.5e9, 12),
    ("175B (GPT-3 size), K = 12", 175e9, 12),
]
for label, psi, k in examples:
    print(f"{label:<42} {model_states(psi, optimizer_multiplier=k) / GB:>8,.0f} GB per GPU")
print(f"\nlargest model whose model states fit in an 80 GB GPU, K = 12: {80 * GB / 16 / 1e9:.0f}B parameters")

# %% [markdown]
# Even 7.5B parameters do not fit on an 80 GB GPU, and GPT-3's 2.8 TB would need 35 of them just to
# hold one replica. Activations come on top, and they grow with the batch size and the sequence
# length rather than with Ψ; ZeRO-DP leaves them alone (activation checkpointing is the usual cure).
#
# ## 2. ZeRO's three stages, on paper
#
# Every data-parallel rank holds the same model states. ZeRO removes the copies one kind at a time;
# rank r keeps slice r of what is partitioned:
#
# | stage | partitions | model states per rank | as N grows |
# | --- | --- | --- | --- |
# | data parallelism (stage 0) | nothing | (2 + 2 + K)Ψ | 16Ψ |
# | ZeRO-1 (P_os) | optimizer states | (2 + 2)Ψ + KΨ/N | → 4Ψ, 4x less |
# | ZeRO-2 (P_os+g) | optimizer states, gradients | 2Ψ + (2 + K)Ψ/N | → 2Ψ, 8x less |
# | ZeRO-3 (P_os+g+p) | optimizer states, gradients, parameters | (2 + 2 + K)Ψ/N | → 0, N times less |
#
# Figure 1 of the ZeRO paper puts numbers on it: Ψ = 7.5B, N = 64, K = 12.

# %%
figure1 = viz.explorer_numbers(7.5e9, 64, 12)
for s in figure1["stages"]:
    print(
        f"{s['name']:<14} {s['formula']:<16} {s['total_gb']:6.1f} GB per GPU "
        f"({figure1['stages'][0]['total'] / s['total']:4.1f}x less than data parallelism)"
    )
assert [round(t, 1) for t in figure1["totals_gb"]] == [120.0, 31.4, 16.6, 1.9]
model_states_bars(7.5e9, 64)

# %% [markdown]
# Memory is only half of the story: partitioned state has to be brought back together, and that
# costs communication. The rest of the notebook runs the stages for real and looks at both.
#
# ## 3. Training the tiny GPT four ways
#
# The same tiny GPT, the same seed, the same global batch (8 rows, 4 per rank), 3 AdamW steps, with
# four strategies: `ddp` (bucketed, overlapped data parallelism from notebook 02), `zero1`, `zero2` and
# `zero3`. Each runs once in fp32 and once in mixed precision (bf16 parameters and gradients, fp32
# master weights and Adam states: exactly the 2 + 2 + 12 of section 1). Four more runs: ZeRO-1 with
# `reduce="all_reduce"`, for section 7, ZeRO-1 as Megatron-LM runs it (section 4), ZeRO-3 with buckets and ZeRO-1
# with its bf16 gradients reduced in fp32 (section 5).
#
# A launch starts fresh Python processes, which costs more than three steps of this model, so one
# `toolkit.launch` trains all twelve configurations in a row: `toolkit.train.train(config)` is the
# toolkit's training loop, and it runs inside any launch. Each call returns that rank's `Run` (its
# trace of collectives, memory samples and losses), which we merge over the ranks.
#
# Gradients are grouped into buckets of about a quarter of the model (the default 25 MiB would hold
# this whole model in one bucket), so that collectives *during* backward are visible.

# %%
PSI = tiny_gpt(**MODEL).num_params()
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


def config(strategy, mixed_precision=False, **options):
    if strategy != "zero3":  # ZeRO-3 communicates per module, not per bucket
        options["bucket_cap_mb"] = PSI * (2 if mixed_precision else 4) / 4 / 2**20
    if mixed_precision:
        options["mixed_precision"] = mixed_precision
    return TrainConfig(
        strategy=strategy, steps=STEPS, global_batch_size=4 * WORLD, model=dict(MODEL), options=options, progress=False
    )


configs = {name: config(name) for name in STRATEGIES}
configs["zero1 all_reduce"] = config("zero1", reduce="all_reduce")
configs["zero1 overlapped"] = config("zero1", overlap_grad_reduce=True, overlap_param_gather=True)
configs["zero3 buckets"] = config("zero3", prefetch_bucket_size=PSI // 4, reduce_bucket_size=PSI // 4)
configs.update({f"{name} bf16": config(name, mixed_precision=True) for name in STRATEGIES})
configs["zero1 bf16, fp32 gradients"] = config("zero1", mixed_precision=dict(param_dtype="bf16", reduce_dtype="fp32"))


def train_each(configs):
    """On every rank: train each configuration in turn; return this rank's Runs."""
    from toolkit.train import train

    return [train(c) for c in configs]


per_rank = toolkit.launch(train_each, WORLD, args=(list(configs.values()),), quiet=True)
runs = {label: Run.merge(rank_runs[i] for rank_runs in per_rank) for i, label in enumerate(configs)}

print(f"tiny GPT {MODEL}: Ψ = {PSI:,} parameters, {WORLD} ranks, {STEPS} steps each")
show_table(
    [{"run": label, **{f"loss, step {s}": round(v, 5) for s, v in run.metric("loss")}} for label, run in runs.items()]
)

# %% [markdown]
# Every fp32 strategy produces the same losses, and so does every bf16 one: ZeRO changes *where* the
# bytes live and which collectives move them, not the arithmetic of training. (bf16 differs from fp32
# in the third decimal: the forward pass rounds to 8 bits of mantissa. The `tests/` prove parity with
# one process to 1e-5 in fp32.)
#
# ## 4. Step by step: which collective runs when
#
# The trace of each run records every collective: its name, the phase of the training loop it ran
# in (forward, backward, optimizer), its size and the bytes this rank sent. Below, for each stage, the
# timeline of the last step on both ranks (communication lane above compute lane; hover a span for
# its details) and a table of that step's collectives on rank 0.


# %%
def in_last_step(run):
    """A predicate: did this event start inside its own rank's last training step?"""
    windows = {rank: step_windows(run, rank)[-1] for rank in run.ranks}
    return lambda e: windows[e["rank"]][0] <= e["start"] <= windows[e["rank"]][1]


def collectives_of_one_step(run, rank=0):
    """Rank `rank`'s collectives in the last step, grouped by (phase, collective), in order of appearance."""
    keep, rows = in_last_step(run), {}
    for e in run.comm_events(rank):
        if keep(e):
            row = rows.setdefault(
                (e["phase"], e["name"]),
                {"phase": e["phase"], "collective": e["name"], "calls": 0, "tensor bytes": 0, "bytes sent": 0},
            )
            row["calls"] += 1
            row["tensor bytes"] += e["args"]["size_bytes"]
            row["bytes sent"] += e["args"]["bytes_sent"]
    return list(rows.values())


def show_step(label):
    run = runs[label]
    rows = collectives_of_one_step(run)
    show_table(rows + [{"phase": "total", "bytes sent": sum(r["bytes sent"] for r in rows)}])
    return viz.timeline(run, where=in_last_step(run), title=f"{label}: one training step on every rank")


# %% [markdown]
# ### Data parallelism (DDP), the baseline
#
# Every rank holds everything. As backward produces gradients, each full bucket is all-reduced
# asynchronously while backward goes on; at the end every rank has the whole averaged gradient and
# runs the same optimizer step on the whole model, redundantly.

# %%
show_step("ddp")

# %% [markdown]
# ### ZeRO-1: partition the optimizer states
#
# 1. **Forward** with the full parameters, as in DDP: no communication.
# 2. **Backward** fills a full, local gradient buffer; nothing is sent yet.
# 3. **End of backward: reduce-scatter** each bucket of gradients: rank r receives the *average* of
#    slice r only. (An all-reduce would deliver all slices, but rank r only updates slice r.)
# 4. **Optimizer step** on slice r: rank r keeps fp32 master weights and Adam states for its slice
#    only. That is the KΨ/N.
# 5. **All-gather** the updated slices, so that every rank has the new parameters for the next forward.
#
# Reduce-scatter plus all-gather is exactly an all-reduce cut in two halves with the optimizer step
# in the middle, so ZeRO-1 sends what DDP sends.

# %%
show_step("zero1")

# %% [markdown]
# ### ZeRO-2: partition the gradients too
#
# Like ZeRO-1, except for when gradients are reduced: each bucket is reduce-scattered **during
# backward**, as soon as its gradients are complete, and the full gradients of that bucket are freed
# right away. A rank never holds more than its slice plus the buckets in flight: 2Ψ/N instead of 2Ψ.
# The reduce-scatters move into the backward phase and overlap with the rest of backward; the
# all-gather after the step stays.

# %%
show_step("zero2")

# %% [markdown]
# ### ZeRO-1 as Megatron-LM runs it: the same bytes, inside the passes
#
# Megatron-LM's *distributed optimizer* is ZeRO-1 with two overlaps, here under its flags' names.
# `overlap_grad_reduce=True` reduce-scatters each bucket during backward as soon as it is complete (ZeRO-2's
# schedule, but the full gradients stay). `overlap_param_gather=True` leaves the updated parameters out of date
# after the step: the next forward all-gathers each bucket just before the first module that needs it, with the
# next bucket's gather already started. The collectives move into the forward and backward passes, where a GPU's
# compute hides them; Megatron-Core's published H100 runs used both (`bench/published_runs.py`).

# %%
overlapped = collectives_of_one_step(runs["zero1 overlapped"])
assert {(r["phase"], r["collective"]) for r in overlapped} == {
    ("forward", "all_gather"),
    ("backward", "reduce_scatter"),
}
assert sum(r["bytes sent"] for r in overlapped) == sum(r["bytes sent"] for r in collectives_of_one_step(runs["zero1"]))
show_step("zero1 overlapped")

# %% [markdown]
# ### ZeRO-3: partition the parameters too
#
# Now a rank stores only its slice of the parameters, so a module's weights must be fetched before
# the module can compute. The toolkit's ZeRO-3 works per module (the DeepSpeed way): every module
# that owns parameters is a unit with its own flat buffer.
#
# 1. **Forward**: just before a module runs, **all-gather** its parameters; right after, free them.
# 2. **Backward**: just before the module's backward, **all-gather** them again; once its gradients
#    are complete, **reduce-scatter** them into the owners' slices and free both.
# 3. **Optimizer step** on slice r. No all-gather afterwards: the next forward gathers on demand.
#
# So every step moves the parameters three times instead of two, in many small collectives, one per
# unit. The tiny GPT has these units (the tied output head shares the token embedding's unit):

# %%
model = tiny_gpt(**MODEL)
seen, units = set(), []
for name, module in model.named_modules():
    new = [p for p in module.parameters(recurse=False) if id(p) not in seen]
    seen.update(id(p) for p in module.parameters(recurse=False))
    if new:
        units.append((name, sum(p.numel() for p in new)))
print(f"{len(units)} units: " + ", ".join(f"{name} ({numel:,})" for name, numel in units))
show_step("zero3")

# %% [markdown]
# Read the table: 15 all-gathers in forward (one per unit), 15 in backward, 15 reduce-scatters in
# backward; nothing in the optimizer phase. On a GPU the next unit's all-gather is *prefetched* while
# the current one computes, so the collectives hide behind compute; here they are synchronous and
# visibly in the way. Each small collective also pays a fixed cost, so DeepSpeed gathers the next
# modules together with the current one, up to `prefetch_bucket_size` elements, in one all-gather,
# and reduce-scatters finished modules together up to `reduce_bucket_size`. The toolkit has both
# options for `"zero3"` (0 by default: the picture above). The bytes stay the same, the calls get
# fewer, and the peak grows by up to a bucket. Here they are set to about a block's parameters:

# %%
show_step("zero3 buckets")

# %% [markdown]
# Count again: a few all-gathers and reduce-scatters instead of 15 each, the same bytes. (The first
# step still gathers one module at a time: it records the order in which the modules run, which
# the later steps prefetch in.) `docs/benchmarks.md` measures what that is worth against FSDP2.
#
# ## 5. Memory per rank, measured against the formula
#
# During training, the toolkit's memory ledger counted the bytes of the real tensors on each rank at
# every phase boundary: parameters, gradients, optimizer states (including fp32 master weights) and
# activations (what autograd saved for backward). The bars show each category's peak per rank; the
# diamonds show the formula for the model states (params + grads + optimizer). In fp32 with AdamW
# the formula is (4 + 4 + 8)Ψ: the parameters are their own master copy, so K = 8.

# %%
fp32_runs = {name: runs[name] for name in STRATEGIES}
bf16_runs = {name: runs[f"{name} bf16"] for name in STRATEGIES}


def memory_rows(runs_by_name, mixed_precision):
    p, g, k = (2, 2, 12) if mixed_precision else (4, 4, 8)
    stage = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}
    rows = []
    for name, run in runs_by_name.items():
        measured = peak_by_category(run, 0)
        theory = model_states_breakdown(PSI, WORLD, stage[name], param_bytes=p, grad_bytes=g, optimizer_multiplier=k)
        row = {"strategy": name}
        for c in ("params", "grads", "optimizer"):
            row[f"{c} KB (theory)"] = f"{measured[c] / KB:.1f} ({theory[c] / KB:.1f})"
        row["activations KB"] = round(measured["activations"] / KB, 1)
        states = measured["params"] + measured["grads"] + measured["optimizer"]
        row["model states / theory"] = round(states / sum(theory.values()), 3)
        rows.append(row)
    return rows


predicted_fp32 = {name: predicted_model_states(PSI, WORLD, name, False) for name in STRATEGIES}
show_table(memory_rows(fp32_runs, mixed_precision=False))
memory_bars(
    fp32_runs,
    predicted_fp32,
    unit=MB,
    title=f"fp32: measured peak per rank (bars) and (4 + 4 + 8)Ψ under each stage (diamonds), Ψ = {PSI:,}",
)

# %% [markdown]
# And in mixed precision, where the optimizer category holds the fp32 master slice as well as Adam's
# two moments, K = 12:

# %%
predicted_bf16 = {name: predicted_model_states(PSI, WORLD, name, True) for name in STRATEGIES}
show_table(memory_rows(bf16_runs, mixed_precision=True))
memory_bars(
    bf16_runs,
    predicted_bf16,
    unit=MB,
    title="mixed precision: measured peak per rank (bars) and (2 + 2 + 12)Ψ under each stage (diamonds)",
)

# %% [markdown]
# ### Gradients in fp32: how Megatron-LM and DeepSpeed train in bf16
#
# A bf16 gradient has 8 bits of mantissa: summed over many micro-batches or ranks, small contributions vanish.
# Megatron-LM with `--bf16` ("bfloat16 requires gradient accumulation and all-reduce to be done in fp32") and
# DeepSpeed's BF16_Optimizer therefore add each backward's bf16 gradients into fp32 *main gradients* and reduce
# those. The toolkit's ZeRO-1 and ZeRO-2 do the same with FSDP's `mixed_precision=dict(param_dtype="bf16",
# reduce_dtype="fp32")`: the same training, a gradient costs 4 bytes instead of 2, and the reduce-scatter moves
# twice the bytes while the parameters' all-gather stays in bf16.

# %%
main_grads = runs["zero1 bf16, fp32 gradients"]
measured_grads = {
    label: peak_by_category(runs[label], 0)["grads"] for label in ("zero1 bf16", "zero1 bf16, fp32 gradients")
}
sent = {
    label: {r["collective"]: r["bytes sent"] for r in collectives_of_one_step(runs[label])} for label in measured_grads
}
theory = model_states_breakdown(PSI, WORLD, 1, param_bytes=2, grad_bytes=4, optimizer_multiplier=12)
show_table(
    [
        {
            "run": label,
            "grads KB": round(measured_grads[label] / KB, 1),
            **{f"{op} bytes": n for op, n in sent[label].items()},
        }
        for label in measured_grads
    ]
)
bf16, fp32 = measured_grads.values()
assert fp32 == 2 * bf16 and abs(fp32 - theory["grads"]) <= WORLD * 4  # "4 bytes instead of 2", within the padding
assert sent["zero1 bf16, fp32 gradients"]["reduce_scatter"] == 2 * sent["zero1 bf16"]["reduce_scatter"]  # "twice"
assert sent["zero1 bf16, fp32 gradients"]["all_gather"] == sent["zero1 bf16"]["all_gather"]  # "stays in bf16"
assert max(abs(a - b) for (_, a), (_, b) in zip(main_grads.metric("loss"), runs["zero1 bf16"].metric("loss"))) < 0.1

# %% [markdown]
# What the numbers say:
#
# - **ZeRO 1, 2, 3 match the formula** category by category: with N = 2, ZeRO-1 halves the optimizer
#   states, ZeRO-2 the gradients too, ZeRO-3 the parameters too. (Each flat buffer is padded to a
#   multiple of N, at most N-1 elements, which is invisible here.)
# - **So does DDP, because its gradients are views of its buckets.** The all-reduce works on flat
#   bucket buffers; after backward each parameter's `.grad` is pointed at its slice of a bucket
#   (torch's `gradient_as_bucket_view=True`), so the gradients exist once. torch's own
#   `DistributedDataParallel` keeps a separate copy by default: a second set of gradients (2Ψ more
#   bytes in mixed precision) that the formula does not count. The formula counts ideas, the ledger
#   counts tensors.
# - The optimizer column is 0.1 KB above the formula for DDP: AdamW keeps a step counter per
#   parameter tensor (28 of them here, 4 bytes each), the ZeRO stages one per flat buffer.
# - **Activations do not change with the stage.** ZeRO-DP partitions model states only. In this tiny
#   model they are the largest category; in a large model with long sequences they often are too,
#   which is why activation checkpointing and sequence/tensor parallelism exist.
# - The ledger samples at phase boundaries, so short-lived buffers inside a phase are not in the bars:
#   ZeRO-3's currently gathered unit (the largest here is an MLP matrix, 16,640 parameters), ZeRO-2's
#   buckets in flight, and DDP's gradients while they wait in `.grad` to be copied into a bucket. On a
#   GPU, the allocator's peak (`torch.cuda.max_memory_allocated`) would include them.
#
# ### torch.autocast: the other way to train in 16 bits
#
# Most PyTorch code trains in 16 bits with `torch.autocast` instead: the weights stay fp32 and the optimizer steps
# them directly (no master copy), while each GEMM casts its input and its weight to 16 bits, every forward, and its
# weight's gradient back to fp32 in backward; LayerNorm, the residual stream and the loss stay fp32. Its model states
# are the recipe's 16 bytes a parameter, split another way: 4 + 4 + 8 against 2 + 2 + 12. It pays in traffic and in
# activations instead. One rank of 8 A100s, simulated with a GPT whose blocks are GPT-3 XL's (d 2,048, 16 heads, 4
# sequences of 1,024): autocast does not reach the simulator's meta tensors, so
# `toolkit.models.as_in_papers.under_autocast` writes its casts into the model (the operations autocast runs, and on
# a CPU its numbers to the bit).

# %%
from toolkit.models.as_in_papers import under_autocast  # noqa: E402
from toolkit.sim import simulate  # noqa: E402

XL_BLOCKS = dict(vocab_size=50304, seq_len=1024, n_layer=4, n_head=16, d_model=2048)
recipes = {
    "torch.autocast (fp32 weights)": (lambda: under_autocast(tiny_gpt(**XL_BLOCKS)), False),
    "bf16 weights, fp32 masters": (lambda: tiny_gpt(**XL_BLOCKS), True),
}
priced = {
    name: simulate(build, "ddp", 8, batch_per_rank=4, mixed_precision=bf16, cluster="dgx-a100", progress=False)
    for name, (build, bf16) in recipes.items()
}
show_table(
    [
        {
            "recipe": name,
            **{f"{k} GB": round(sim.peak_memory[k] / GB, 2) for k in ("params", "grads", "optimizer", "activations")},
            **{f"{k} ms": round(sim.cost.breakdown[k] * 1e3, 1) for k in ("gemm", "memory_bound", "step")},
        }
        for name, sim in priced.items()
    ]
)
amp, masters = priced.values()
states = [sum(sim.peak_memory[k] for k in ("params", "grads", "optimizer")) for sim in (amp, masters)]
assert abs(states[0] / states[1] - 1) < 0.01  # "the recipe's 16 bytes a parameter"
assert amp.peak_memory["activations"] > 1.5 * masters.peak_memory["activations"]  # "nearly twice"
assert amp.cost.breakdown["gemm"] == masters.cost.breakdown["gemm"]  # "the same GEMMs"
assert amp.cost.breakdown["memory_bound"] > 2 * masters.cost.breakdown["memory_bound"]  # "more than twice"
assert amp.step_time > 1.1 * masters.step_time  # "over a tenth longer"

# %% [markdown]
# The same model states and the same GEMMs; nearly twice the activations (the fp32 stream between blocks, and the
# 16-bit copies of inputs and weights autocast keeps for backward), more than twice the memory-bound time (the casts
# and the fp32 stream), a step over a tenth longer. That is why Megatron-LM and DeepSpeed keep 16-bit weights and
# fp32 masters; autocast asks nothing of the model, which is why most code uses it. A published run that trained
# under autocast, priced both ways: flash-attention's GPT3-2.7B in docs/benchmarks.md ("Published runs").
#
# ## 6. Communication: 2Ψ against 3Ψ
#
# Each rank's bytes sent per step, from the trace, against the theory for ring collectives: a
# reduce-scatter or an all-gather of a Ψ-element buffer sends (N-1)/N·Ψ elements, an all-reduce twice
# that. So DDP, ZeRO-1 and ZeRO-2 send **2Ψ(N-1)/N** elements per step and ZeRO-3 sends
# **3Ψ(N-1)/N**, 1.5 times more. With N = 2, (N-1)/N = 1/2: DDP sends Ψ elements per step.
#
# (The trace records for each call the bytes a bandwidth-optimal ring algorithm sends for that
# size. gloo, the CPU backend, actually implements reduce-scatter with an all-reduce, so timings on
# this laptop flatter DDP; the bytes are the algorithmic volume you would get from NCCL.)


# %%
def sent_per_step(run, rank=0):
    """Median over steps of what `rank` sent, in total and per phase."""
    steps = bytes_per_step(run, rank)
    phases = sorted({p for s in steps for p in s} - {"total"})
    return {p: statistics.median(s.get(p, 0) for s in steps) for p in phases + ["total"]}


PHASES = ("forward", "backward", "optimizer")
comm_rows = []
for label, run in runs.items():
    name, element = label.split()[0], (2 if "bf16" in label else 4)
    theory = communication_per_step(PSI, WORLD, name) * element
    sent = sent_per_step(run)
    comm_rows.append(
        {
            "run": label,
            **{f"{p} KB": round(sent.get(p, 0) / KB, 1) for p in PHASES},
            "sent KB/step": round(sent["total"] / KB, 1),
            "theory KB": round(theory / KB, 1),
            "sent / theory": round(sent["total"] / theory, 3),
        }
    )
show_table(comm_rows)
comm_bars(
    [{"strategy": r["run"], "measured": r["sent KB/step"] * KB, "theory": r["theory KB"] * KB} for r in comm_rows],
    title="Bytes each rank sends per step: measured (bars), 2Ψ(N-1)/N or 3Ψ(N-1)/N (diamonds)",
)

# %% [markdown]
# DDP, ZeRO-1 and ZeRO-2 send exactly the same bytes: ZeRO-1/2 only cut DDP's all-reduce into a
# reduce-scatter and an all-gather and put the optimizer step between them, so stages 1 and 2 save
# memory **for free** in communication volume. ZeRO-3 sends 1.5 times as much (the all-gather runs
# twice, in forward and backward), the price of never holding the full parameters. Mixed precision
# halves every number: 16-bit gradients and parameters are what travels.
#
# (The `zero1 all_reduce` row is the odd one out; it is the next section.)
#
# ## 7. ZeRO-1: reduce-scatter or all-reduce?
#
# The first slides about ZeRO-1 often average the gradients with an all-reduce, as DDP does, and
# then let each rank use only its slice. It gives the same result, but it is wasteful: an all-reduce
# is itself a reduce-scatter followed by an all-gather, and its all-gather hands every rank gradient
# slices that it then ignores. The option `reduce="all_reduce"` of the toolkit's ZeRO-1 does exactly
# that, so we can measure the difference:

# %%
ways = {"reduce-scatter (default)": runs["zero1"], 'reduce="all_reduce"': runs["zero1 all_reduce"]}
rows = []
for label, run in ways.items():
    sent = sent_per_step(run)
    rows.append(
        {
            "ZeRO-1 with": label,
            "backward KB": round(sent.get("backward", 0) / KB, 1),
            "optimizer KB": round(sent.get("optimizer", 0) / KB, 1),
            "total KB": round(sent["total"] / KB, 1),
            "x Ψ(N-1)/N": round(sent["total"] / (4 * PSI * (WORLD - 1) / WORLD), 2),
            "final loss": round(run.metric("loss")[-1][1], 5),
            "grads KB": round(peak_by_category(run, 0)["grads"] / KB, 1),
        }
    )
show_table(rows)

# %% [markdown]
# Same loss, same memory (ZeRO-1 keeps a full gradient buffer either way), but 3Ψ(N-1)/N instead of
# 2Ψ(N-1)/N: the all-reduce sends twice what the reduce-scatter does in backward, and the all-gather
# of the updated parameters still follows the step. Choosing the collective that delivers *exactly*
# what each rank needs is what makes ZeRO-1 and ZeRO-2 cost no more traffic than DDP.
#
# ### ZeRO-1 as an optimizer alone
#
# `wrap(model, "zero1")` shards the optimizer inside a strategy that also owns the gradients' reduction.
# PyTorch's `ZeroRedundancyOptimizer` makes the other cut, and so does `toolkit.parallel.shard_optimizer`:
# keep DDP for the gradients, replace only the optimizer. It gives each *whole parameter* an owner rank
# (largest first, to the least loaded rank); the owner alone keeps its Adam states and steps it, then
# broadcasts it to every rank. Same updates as plain AdamW, bit for bit (the first weight agrees on every
# row); on 2 ranks each holds about half the optimizer bytes:


# %%
def plain_or_sharded():
    import functools

    import torch
    import torch.distributed as dist

    from toolkit.memory import ledger
    from toolkit.models import SyntheticCorpus, tiny_gpt
    from toolkit.parallel import shard_optimizer, wrap

    rows = []
    for label, opt in (
        ("DDP + AdamW", torch.optim.AdamW),
        ("DDP + shard_optimizer(AdamW)", functools.partial(shard_optimizer, optimizer_class=torch.optim.AdamW)),
    ):
        torch.manual_seed(0)
        model, optimizer = wrap(tiny_gpt(), "ddp", optimizer=opt)
        x, y = SyntheticCorpus().batch(0, 8, rank=dist.get_rank(), world_size=dist.get_world_size())
        model(x, y).backward()
        optimizer.step()
        rows.append(
            {
                "rank": dist.get_rank(),
                "optimizer": label,
                "optimizer states KB": round(ledger(model, optimizer)["optimizer"] / KB, 1),
                "first weight": round(model.module.tok_emb.weight[0, 0].item(), 6),
            }
        )
    return rows


show_table([row for rank_rows in toolkit.launch(plain_or_sharded, WORLD, quiet=True) for row in rank_rows])

# %% [markdown]
# ## 8. The memory explorer
#
# The formulas of section 2 as a panel: move Ψ (log scale), N, K, the precision of parameters and
# gradients, pick a stage to highlight, and the bars and the printed per-rank totals redraw. The
# dashed line is a device's memory (80 GB by default; set 0 to hide it), and the table says the
# largest model each stage fits in it. With its defaults (Ψ = 7.5B, N = 64, K = 12, 16-bit) it is the
# ZeRO paper's Figure 1: 120 / 31.4 / 16.6 / 1.9 GB.
#
# Some things to try:
#
# - N = 1024 with ZeRO-3: how large a model fits in 80 GB? (The paper's headline: a trillion
#   parameters on 1024 GPUs.)
# - Raise N with ZeRO-1 and ZeRO-2: why do they stop improving, and at what value?
# - Switch to fp32 parameters and gradients with K = 8: how does that compare with mixed precision?

# %%
explorer = viz.memory_explorer(7.5e9, 64, 12, stage=3)
print(explorer.text)
explorer

# %% [markdown]
# ## 9. Activations: what ZeRO leaves alone, counted
#
# Section 5 found the activations the same under every stage, and the largest category in this tiny
# model. How large they are is a formula too. Korthikanti et al. (2022) count what one transformer layer
# keeps for backward, with 16-bit values and dropout: **s·b·h·(34 + 5·a·s/h) bytes** per layer, for
# sequence length s, b rows, hidden size h and a attention heads. The 34·sbh are the inputs of the
# matmuls, LayerNorms and GELU, and two dropout masks; the 5·a·s²·b are the attention scores after the
# softmax, its dropout mask and the dropped-out copy, quadratic in s.
#
# The tiny GPT is not the paper's model in three ways: it computes in fp32 (4 bytes a value, not 2), it has
# no dropout, and its attention is torch's fused `scaled_dot_product_attention`, which never stores the
# s x s scores (it keeps its output and one log-sum-exp per row instead). `toolkit.memory.activation_terms`
# lists the paper's count operation by operation, with those three switches, and can add the small terms
# the paper neglects (each LayerNorm's mean and 1/std per row). The measurement, `activations_by_module`,
# runs one forward and reports what autograd saved while each block ran (section 3's micro-batch: 4 rows
# of 32 tokens):

# %%
from toolkit.memory import activation_bytes, activation_terms, activations_by_module
from toolkit.models import SyntheticCorpus

S, B, H, A = 32, 4, MODEL["d_model"], MODEL["n_head"]
model = tiny_gpt(**MODEL)
x, y = SyntheticCorpus().batch(0, B)
per_block, saved_in_all = activations_by_module(model, model.blocks, x, y)
paper = activation_terms(S, B, H, A)
ours = activation_terms(S, B, H, A, bytes_per_value=4, dropout=False, fused_attention=True, small_terms=True)
show_table(
    [
        {
            "what one layer keeps": term,
            "paper: 16-bit, dropout, scores stored (B)": paper.get(term, "-"),
            "tiny GPT: fp32, no dropout, fused attention (B)": ours[term],
        }
        for term in ours
    ]
    + [
        {
            "what one layer keeps": "total",
            "paper: 16-bit, dropout, scores stored (B)": sum(paper.values()),
            "tiny GPT: fp32, no dropout, fused attention (B)": sum(ours.values()),
        }
    ]
)
predicted = sum(ours.values())
print(
    f"measured per block: {per_block} bytes; predicted {predicted:,.0f}; "
    f"the paper's s·b·h·(34 + 5·a·s/h) = {activation_bytes(S, B, H, A):,.0f} "
    f"({activation_bytes(S, B, H, A) / per_block[0] - 1:+.0%} against the measurement)"
)
print(f"outside the blocks (embeddings, final LayerNorm, the logits): {saved_in_all - sum(per_block):,} bytes")

# %% [markdown]
# The terms, with the tiny GPT's switches, predict every block to the byte. The paper's formula, as
# published, misses by its assumptions, not its method: at 16 bits the tiny GPT would keep half as much,
# without dropout 2·sbh less, and the quadratic term, 5·a·s/h = 10 against 34 here, is nearly a quarter of
# the formula while the fused kernel keeps none of it. How that term grows with the sequence, measured
# with the fused kernel and with the plain softmax path that stores the scores (torch's `MATH` backend):

# %%
from torch.nn.attention import SDPBackend, sdpa_kernel

rows = []
for seq in (16, 32, 64, 128):
    net = tiny_gpt(**MODEL, seq_len=seq)
    xs, ys = SyntheticCorpus(seq_len=seq).batch(0, B)
    fused = activations_by_module(net, net.blocks[:1], xs, ys)[0][0]
    with sdpa_kernel(SDPBackend.MATH):
        stored = activations_by_module(net, net.blocks[:1], xs, ys)[0][0]
    terms = {
        kernel: sum(
            activation_terms(
                seq, B, H, A, bytes_per_value=4, dropout=False, small_terms=True, fused_attention=kernel == "fused"
            ).values()
        )
        for kernel in ("fused", "math")
    }
    rows.append(
        {
            "s": seq,
            "fused, measured KB": round(fused / KB, 1),
            "fused, terms KB": round(terms["fused"] / KB, 1),
            "scores stored, measured KB": round(stored / KB, 1),
            "scores stored, terms KB": round(terms["math"] / KB, 1),
            "paper (16-bit, dropout) KB": round(activation_bytes(seq, B, H, A) / KB, 1),
        }
    )
show_table(rows)

# %% [markdown]
# Both kernels match their terms exactly. With the scores stored, doubling s more than doubles the bytes
# (the s² term); the fused kernel grows linearly, which is much of why FlashAttention made long sequences
# affordable. On a real model the count is sobering. GPT-3 (s = 2048, h = 12288, a = 96, 96 layers), one
# row per micro-batch, against its model states under ZeRO-3 over 64 GPUs:

# %%
gpt3 = activation_bytes(2048, 1, 12288, 96, layers=96)
print(f"activations, paper's formula:  {gpt3 / GB:6.0f} GB per GPU per row of 2048 tokens")
print(f"model states, ZeRO-3 over 64:  {model_states(175e9, 64, 3) / GB:6.0f} GB per GPU")
print(f"activations, keeping only each layer's input (2·sbh, full recomputation): {96 * 2 * 2048 * 12288 / GB:.1f} GB")

# %% [markdown]
# ZeRO divides the model states by N; nothing here divides the activations. The usual cure is
# **activation checkpointing**: keep only each layer's input during forward and recompute the layer's
# forward during backward, when its gradients are due; about a third more computation for most of the
# activation memory. Notebook 04 (section 9) measures both sides of that trade with FSDP's
# `activation_checkpointing=True`. (Where the toolkit's ZeRO differs from DeepSpeed's: `docs/differences.md`.)

# %% [markdown]
# ## What to remember
#
# - Model states cost (2 + 2 + K)Ψ bytes per rank under data parallelism: 16 bytes per parameter with
#   mixed-precision Adam (K = 12), before activations.
# - ZeRO-1 partitions the optimizer states, ZeRO-2 the gradients too, ZeRO-3 the parameters too:
#   4Ψ + KΨ/N, 2Ψ + (2 + K)Ψ/N, (2 + 2 + K)Ψ/N. The measurements match, padding aside.
# - ZeRO-1 and ZeRO-2 send what DDP sends, 2Ψ(N-1)/N, because a reduce-scatter and an all-gather add
#   up to an all-reduce. ZeRO-3 sends 3Ψ(N-1)/N, gathering parameters in forward and again in backward.
# - Activations are untouched by ZeRO-DP: s·b·h·(34 + 5·a·s/h) bytes per layer in the paper's model,
#   exactly its terms once the model's precision, dropout and attention kernel are plugged in.
#
# ## Questions
#
# 1. With Ψ = 7.5B and K = 12, from what N on does ZeRO-2 need less than 20 GB per GPU? Does ZeRO-1
#    ever get there?
# 2. torch's `DistributedDataParallel` keeps, by default, the gradients in `.grad` *and* in its
#    buckets. What would the DDP row of the section 5 table show then, and how large would the
#    difference be for a 7.5B-parameter model in mixed precision?
# 3. ZeRO-3 all-gathers each unit twice per step. Why can it not simply keep the parameters gathered
#    in forward until the backward needs them again? What would that cost in memory?
# 4. The tiny GPT's token embedding and output head share one matrix. In the ZeRO-3 table, how many
#    all-gathers would there be in forward if the head gathered that matrix again? Why does the
#    toolkit keep it gathered until the head has run?
# 5. Mixed precision halved the bytes communicated but not the optimizer states. Why?
