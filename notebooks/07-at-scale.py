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
# # 07 · At cluster scale
#
# Every lesson so far ran on 2 to 4 ranks of a laptop. The papers talk about something else: GPT-3 175B
# on 512 GPUs (the FSDP paper), a 7.5B-parameter model on 64 GPUs (ZeRO's Figure 1), 64 experts on 64
# GPUs (FasterMoE, Tutel). Nobody can run that on a CPU. But we can run **the same strategy code**, the
# files you read in lessons 02 to 04, for *one* rank of such a cluster, in this notebook's process:
#
# - torch ships a **fake process group**: this process becomes rank 0 of 512, and every collective
#   "completes" at once without moving data (shapes right, values not);
# - the model is built on the **meta device**: tensors with shapes and dtypes but no memory, so a
#   175B-parameter model costs nothing to build;
# - `toolkit.parallel.wrap(model, "zero3")` then runs exactly as on a real rank: it flattens, pads and
#   shards; the training step gathers, frees and reduce-scatters; the collectives door records every call.
#
# What comes out is exact wherever the answer depends only on sizes: the bytes of every tensor (memory per
# category, and its peak), the bytes of every collective, the FLOPs of every operation. What does not come
# out is *time*: nothing ran. Part 2 of this lesson adds a cost model for that.
#
# 1. What would this take on 512 GPUs? (memory and bytes, from the strategies' own code)
# 2. How long would a step take? (part 2: the cost model)

# %%
import torch

import toolkit
from toolkit.memory import formulas, model_states
from toolkit.models import presets, tiny_gpt
from toolkit.sim import Collective, Compute, simulate
from toolkit.units import bytes_text, count_text, seconds_text

GB = 1e9

# %% [markdown]
# ## 1. What would this take on 512 GPUs?
#
# ### A first simulated rank
#
# Start small: the tiny GPT under ZeRO-3 on 4 simulated ranks. `simulate` builds the model on meta, wraps
# it, runs a warm-up step and then one measured step, and returns a `Simulation`. Its `programs` hold the
# step as the rank issued it: compute (with its FLOPs), a collective, a wait, compute, ... in order.

# %%
sim = simulate(lambda: tiny_gpt(n_layer=2, d_model=64, n_head=4), "zero3", world_size=4, progress=False)
print(sim.summary())
for instruction in sim.programs[-1][:9]:
    if isinstance(instruction, Compute):
        print(f"  compute     {instruction.flops:>12,.0f} FLOPs  {instruction.phase:<9} {instruction.label}")
    elif isinstance(instruction, Collective):
        print(
            f"  collective  {instruction.op:<15} {instruction.size_bytes:>8,} B  {instruction.phase:<9} "
            f"for {instruction.label}"
        )
    else:
        print(f"  wait        for collective {instruction.id}")

# %% [markdown]
# ZeRO-3 at work, from its own code: before each module's forward an all-gather brings its parameters,
# and the rank waits for it at once (nothing else to do); backward gathers again and reduce-scatters the
# gradients. The same numbers as on real ranks: `tests/test_sim_vs_real.py` holds the simulated rank to a
# real gloo run of every strategy, byte for byte.
#
# ### ZeRO's Figure 1, from the strategies' own tensors
#
# The ZeRO paper's Figure 1: a 7.5B-parameter model on 64 GPUs with mixed-precision Adam needs 120 GB per
# GPU under plain data parallelism, 31.4 under ZeRO-1, 16.6 under ZeRO-2, 1.9 under ZeRO-3. Lesson 03
# derived that with a formula. Here the four strategies build their buffers and run a step for rank 0 of
# 64, and we count the bytes of the tensors they keep (a few seconds each: the model has 36 layers).

# %%
figure1 = []
for strategy, stage in (("ddp", 0), ("zero1", 1), ("zero2", 2), ("zero3", 3)):
    s = simulate(presets.zero_7_5b, strategy, 64, seq_len=128, warmup=False, progress=False, mixed_precision=True)
    formula = model_states(s.num_params, 64, stage)
    figure1.append(
        {
            "strategy": strategy,
            "simulated GB per rank": round(s.memory["total"] / GB, 3),
            "formula GB": round(formula / GB, 3),
            "paper GB": {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}[stage],
            "simulated - formula": bytes_text(s.memory["total"] - formula),
            "_extra": s.memory["total"] - formula,
        }
    )
print(f"{count_text(s.num_params)} parameters")
for row in figure1:
    print({k: v for k, v in row.items() if not k.startswith("_")})

# %% [markdown]
# The strategies' tensors agree with the paper's figure (to its rounding: its model has 7.5B parameters, this one
# 7.49B) and with (2 + 2 + 12)Ψ to a few kilobytes out of gigabytes (the last column): the
# padding that makes every flat buffer split evenly over 64 ranks (at most 63 elements of 16 bytes per buffer),
# and Adam's 4-byte step counters, one per tensor it updates.

# %%
for row in figure1:  # the sentence above, checked; and the paper's numbers, to their rounding
    assert 0 <= row["_extra"] < 100e3, row
    assert abs(row["simulated GB per rank"] / row["paper GB"] - 1) < 0.02, row

# %% [markdown]
# ### GPT-3 175B on 512 GPUs
#
# The FSDP paper trains GPT-3 175B (96 layers, d_model 12288) on up to 512 A100s. Each rank keeps
# (2+2+12)Ψ/512 of model states, and every step moves the 16-bit model three times (gather in forward,
# gather in backward, reduce-scatter): 3·2Ψ·(N-1)/N sent per rank. With hybrid sharding (shard inside each
# 8-GPU node, replicate across nodes) only a gradient all-reduce of the node's shard leaves the node:
# 2M(W-1)/(GW) instead of 3M(W-1)/W. The cell prints those formulas for the whole model.
#
# The full 96 layers take a while per strategy (`.venv/bin/python -m toolkit simulate --model gpt3-175b`). But
# the layers are identical: whatever a rank holds or sends grows by the same amount with each layer. So we
# simulate 3 and 4 layers at the full width (a second each) and extrapolate to 96 (`toolkit.sim.sweep`; its
# test holds the extrapolation to a whole-model simulation). Priced on a DGX A100 cluster, each case also
# answers the first question anyone asks at this scale: does it fit in the GPU's 80 GB?

# %%
from toolkit.sim.sweep import BASE, extrapolate  # noqa: E402

with torch.device("meta"):
    PSI = sum(p.numel() for p in presets.gpt3_175b().parameters())
print(
    f"GPT-3: {count_text(PSI)} parameters; (2+2+12)Ψ/512 = {16 * PSI / 512 / GB:.2f} GB of model "
    f"states per rank; 3·2Ψ·511/512 = {3 * 2 * PSI * 511 / 512 / 1e12:.2f} TB sent per rank and step "
    f"(hybrid, across nodes: {formulas.fsdp_cross_host_traffic(2 * PSI, 8, 512, 'hybrid') / GB:.0f} GB)"
)
CASES = {
    "ddp": ("ddp", {}),
    "zero3": ("zero3", {}),
    "fsdp": ("fsdp", {}),
    "hsdp": ("fsdp", {"sharding_group_size": 8}),
    "fsdp + checkpointing": ("fsdp", {"activation_checkpointing": True}),
}
gpt3 = {}
for name, (strategy, options) in CASES.items():
    sims = [
        simulate(
            lambda n=n: presets.gpt3_175b(n_layer=n),
            strategy,
            512,
            progress=False,
            mixed_precision=True,
            cluster="dgx-a100",
            **options,
        )
        for n in BASE
    ]  # a steady step: Adam's states alive throughout
    gpt3[name] = (sims[-1], extrapolate(*sims, 96))
for name, (s, whole) in gpt3.items():
    F = s.options.get("sharding_group_size", 512)
    sharding = "full_replication" if s.strategy == "ddp" else "hybrid" if F < 512 else "full_shard"
    cross = formulas.fsdp_cross_host_traffic(2 * s.num_params, 8, 512, sharding)
    assert abs(s.cross_node_bytes / cross - 1) < 0.02, name  # hybrid: the paper's 2M(W-1)/(GW) for 2M(W-G)/(GW)
    print(
        f"{name:<21} {BASE[-1]} layers: sent {bytes_text(s.bytes_per_step['total']):>8}, across nodes "
        f"{bytes_text(s.cross_node_bytes):>8} (paper's formula {bytes_text(cross):>8})"
        f" | 96 layers: states {bytes_text(whole['states']):>8}, peak "
        f"{bytes_text(whole['peak']):>8}: {'fits' if whole['fits'] else 'DOES NOT FIT'}"
    )

# %% [markdown]
# Read the peaks. Plain data parallelism keeps 2.8 TB of model states on every GPU: it never fits. Sharded,
# the model states are a few GB per rank, yet the peak is many times that. It is made of what the step holds
# at one moment: the gathered units (FSDP: the unit computing, the next one prefetched, and the root unit with
# the embeddings, needed first and last in backward), the activations of a 2048-token sequence in every layer,
# and the gradients on their way to a reduce-scatter. Without activation checkpointing the activations of 96
# layers alone take nearly all of a GPU's memory (printed below): zero3 and fsdp do not fit; the FSDP paper's
# configuration (checkpointing: each block keeps only its input, and recomputes the rest in backward) does. Hybrid sharding
# keeps its gathers inside the node, so far fewer bytes cross the network, for 64 times the model states per GPU
# (1/8 of the model instead of 1/512): for GPT-3, more than a GPU holds.
# `sim.fit` says what would make a case fit:

# %%
for name, (_sim, whole) in gpt3.items():
    assert whole["peak"] > 2 * whole["states"] or name in ("ddp", "hsdp"), name  # "the peak is many times that"
    assert whole["fits"] == (name == "fsdp + checkpointing"), name  # which fit, as the text says
assert gpt3["hsdp"][0].cross_node_bytes < gpt3["fsdp"][0].cross_node_bytes / 2
assert gpt3["ddp"][1]["states"] > 2.7e12 and gpt3["hsdp"][1]["states"] > 80 * GB
assert abs(gpt3["hsdp"][1]["states"] / gpt3["fsdp"][1]["states"] - 64) < 1
assert all(1e9 < whole["states"] < 1e10 for name, (_, whole) in gpt3.items() if name in ("zero3", "fsdp"))
for name in ("zero3", "fsdp"):  # "the activations of 96 layers alone take nearly all of a GPU's memory"
    whole = gpt3[name][1]
    print(
        f"{name}: activations {bytes_text(whole['peak_memory']['activations'])} of its "
        f"{bytes_text(whole['peak'])} peak, on a GPU of {bytes_text(whole['fit'].capacity)}"
    )
    assert 0.8 * whole["fit"].capacity < whole["peak_memory"]["activations"] < whole["peak"]
print(gpt3["zero3"][1]["fit"].text())

# %% [markdown]
# ### Try it
#
# Pick a model, a strategy, a number of GPUs and a cluster (DGX A100 or DGX H100 nodes of 8 GPUs), then
# "simulate". The panel simulates 3 and 4 layers of the model at its full width (two depths 2 or 4 apart when one
# block in 2 or 4 is checkpointed) and extrapolates to its full depth (every click: a few seconds for the big models), then draws what rank 0 holds at its peak, every
# category, against the GPU's memory, says whether it fits (and, if not, what would), and, when it fits, how
# long a step takes. MoE-GPT-S trains its dense part with ddp (its experts are expert-parallel); activation
# checkpointing is an option of every strategy.

# %%
from toolkit.viz.scale_explorer import scale_case, scale_explorer  # noqa: E402

scale_explorer(activation_checkpointing=True)  # the FSDP paper's configuration, drawn before you touch anything

# %% [markdown]
# Checkpointing need not be all or nothing. "every 2nd block" recomputes one block in 2 and stashes the others
# (`activation_checkpointing=2`, fms-fsdp's `selective_checkpointing`): for GPT-3 on 512 GPUs under fsdp it fits
# too, holding more activations than checkpointing every block, and its step is shorter, since backward
# recomputes half as many forwards. "every block, by operation" (`activation_checkpointing="op"`, torchtitan's
# policy) checkpoints every block but keeps the outputs of its attention and of every other matmul: it fits as
# well, and its step is shorter than checkpointing every block, since it recomputes mostly the cheap operations:

# %%
ac_rows = {c: scale_case("GPT-3 175B", "fsdp", 512, activation_checkpointing=c) for c in (True, 2, "op")}
for label, row in zip(("every block", "every 2nd block", "by operation"), ac_rows.values()):
    print(f"{label:<16} peak {bytes_text(row['peak']):>8}, fits: {row['fits']}, step {seconds_text(row['step_time'])}")
assert all(row["fits"] for row in ac_rows.values()) and ac_rows[True]["peak"] < min(
    ac_rows[2]["peak"], ac_rows["op"]["peak"]
)
assert max(ac_rows[2]["step_time"], ac_rows["op"]["step_time"]) < ac_rows[True]["step_time"]

# %% [markdown]
# ## 2. How long would a step take?
#
# Everything above is sizes: bytes and FLOPs. Each `Simulation` also holds `programs`, the step in the
# order the rank issued it (compute, collective, wait). The cost model (`toolkit.sim.cost`) turns that
# into time on a cluster with three rules:
#
# - **compute**: every operation priced on its own, from the accelerator's datasheet and the operation's shape
#   (`toolkit/sim/kernel_time.py`): a GEMM as cuBLAS runs it, its output cut into tiles that run in waves on
#   the SMs at the best rate a GEMM microbenchmark reaches (a partial tile or wave costs a whole one, so small
#   or odd shapes run slower); a fused attention likewise, plus its softmax on the ordinary FP32 units;
#   anything else (layer norms, adds, the optimizer) at the memory's bandwidth; and a launch cost per
#   operation, hidden where the GPU is busier than the host. Nothing is fitted to a paper's table;
# - **communication**: the alpha-beta model of the links a collective crosses: NVLink inside a node,
#   one network card per GPU between nodes (a ring across nodes uses all 8 cards of a node at once; a
#   group with one GPU per node, like HSDP's replicas, gets one card);
# - **overlap**: a collective starts when the compute issued before it is done and its link is free; the
#   compute stream stalls only at a `Wait`. That is why buckets and prefetching pay.
#
# `simulate(..., cluster=...)` fills `sim.fit` (the peak against the GPU's memory, as above) and, for a job that
# fits, `sim.step_time`, `sim.breakdown` (compute, exposed and overlapped communication), `sim.tflops_per_gpu`
# (the cluster's useful rate: all ranks' FLOPs / GPUs / step time), `sim.mfu` and `sim.modelled_run`, a Run with
# the same spans as a real trace. A job that does not fit gets no time: it would stop at its first peak. The
# presets, each with its sources:

# %%
from toolkit.sim import held_to_runs, price  # noqa: E402
from toolkit.sim.calibrate import this_machine  # noqa: E402
from toolkit.train import TrainConfig, launch_train  # noqa: E402

for name, description in toolkit.sim.presets().items():
    print(f"{name:<13} {description}")

# %% [markdown]
# ### First, how far to trust it: a prediction next to a real run, on this machine
#
# `"this-machine"` is measured, not looked up: the matmul rate, the cost of one operation, the loopback
# alpha-beta of every collective, and the fraction of peak a small reference GPT reaches, all with every
# rank busy at once (`simulate(..., cluster="this-machine")` measures once and caches it; here we measure
# again, right before the run, because a shared machine's load changes by the minute). Then we predict an
# FSDP step of another model on 2 ranks, and run the same thing for real.

# %%
MODEL = dict(n_layer=3, d_model=96, n_head=4)
machine = this_machine(2, refresh=True)  # measured now, next to the run below: the machine's load changes
predicted = simulate(
    lambda: tiny_gpt(vocab_size=128, seq_len=64, **MODEL), "fsdp", 2, batch_per_rank=8, progress=False, cluster=machine
)
real = launch_train(
    TrainConfig(
        strategy="fsdp",
        steps=5,
        global_batch_size=16,
        model=MODEL,
        vocab_size=128,
        seq_len=64,
        progress=False,
        sample_memory=False,
    ),
    world_size=2,
)
slowest = {}  # step -> the slowest rank's time: a step is done when its last rank is
for r in real.ranks:
    for step, seconds in real.metric("step_time", rank=r):
        slowest[step] = max(slowest.get(step, 0.0), seconds)
measured = sorted(slowest[step] for step in range(1, 5))[2]
print(
    f"predicted {seconds_text(predicted.step_time)}, measured {seconds_text(measured)} (slowest rank, median of "
    f"the last 4 steps): error {predicted.step_time / measured - 1:+.0%}"
)
print(predicted.cost.summary())
print(f"machine.overlap = {machine.overlap:.2f} of a collective can hide behind compute here")

# %% [markdown]
# On a quiet machine most predictions land within 20% (`docs/benchmarks.md`, "Simulator accuracy", holds
# the numbers for every strategy); under load from other work, errors of tens of percent, either way, are
# usual (the machine's load is printed above). Two things the calibration measures make that possible on a
# CPU: a collective's cost as a step pays it (compute between calls, the mean with its slow tail, not
# back-to-back calls), and how little of it hides behind compute (`machine.overlap`: gloo's threads copy on
# the cores the ranks compute on, so prefetching buys little here, unlike on a GPU). The published
# simulators (vTrain, ASTRA-sim) reach 8-20% on GPU clusters.
# Compare the two timelines: the same spans in the same order, measured above, modelled below.

# %%
start, end = toolkit.trace.analysis.step_windows(real, 0)[3]
toolkit.viz.timeline(
    real, ranks=[0], where=lambda e: start <= e["start"] < end, title="measured: rank 0, step 3"
).show()
modelled = toolkit.viz.timeline(predicted.modelled_run, title="modelled: rank 0 of 2, one step")
b = predicted.breakdown  # the timeline's overlap is the cost model's: hidden / (hidden + exposed) communication
shown = int(modelled.layout.title.subtitle.text.split("computation: ")[1].split("%")[0])
assert abs(shown - 100 * b["overlapped_comm"] / max(b["overlapped_comm"] + b["exposed_comm"], 1e-12)) <= 1.5
modelled

# %% [markdown]
# ### GPT-3 175B on 512 A100s
#
# The FSDP paper reports 173-186 TFLOP/s per GPU for GPT-3 175B on 128 to 512 A100s. Its configuration:
# full sharding, bf16, activation checkpointing, prefetching, one 2048-token sequence per GPU. Three and four
# of the 96 layers at the full width show the per-layer balance in a second, and extrapolate to the whole
# model.

# %%
paper = [
    simulate(
        lambda n=n: presets.gpt3_175b(n_layer=n),
        "fsdp",
        512,
        progress=False,
        mixed_precision=True,
        activation_checkpointing=True,
        forward_prefetch=True,
        cluster="dgx-a100",
    )
    for n in BASE
]
gpt3_sim, whole = paper[-1], extrapolate(*paper, 96)
h100 = price(gpt3_sim, "dgx-h100")
print(gpt3_sim.cost.summary())
print(h100.summary())
PAPER = (173, 186)  # TFLOP/s per GPU, the FSDP paper's GPT-175B on 128-512 A100
print(
    f"96 layers: {whole['tflops_per_gpu']:.0f} TFLOP/s per GPU (the paper: {PAPER[0]}-{PAPER[1]}), exposed "
    f"communication {seconds_text(whole['breakdown']['exposed_comm'])} of a {seconds_text(whole['step_time'])} step"
)
faster = {
    "step": gpt3_sim.step_time / h100.step_time,
    "compute": gpt3_sim.breakdown["compute"] / h100.breakdown["compute"],
}
print(
    f"the H100 cluster's step is {faster['step']:.1f}x shorter, its compute {faster['compute']:.1f}x; compute is "
    f"{h100.breakdown['compute'] / h100.step_time:.0%} of its step"
)
assert whole["breakdown"]["exposed_comm"] < 0.1 * whole["step_time"]  # "almost all hidden", below
assert whole["tflops_per_gpu"] > PAPER[1]  # "above the paper's measurement"
assert abs(faster["step"] / faster["compute"] - 1) < 0.15 and h100.breakdown["compute"] > 0.75 * h100.step_time
fared = {name: [g.took for g in groups] for name, groups in held_to_runs.PRESETS.items()}  # the `trust:` lines
assert h100.trust and gpt3_sim.cost.trust and max(fared["dgx-a100"][0]) < min(fared["dgx-h100"][0])
assert min(fared["dgx-h100"][0]) > 1.2 and max(fared["dgx-a100"][0]) < 7 / 6  # "a fifth or more", "a sixth"
toolkit.viz.timeline(gpt3_sim.modelled_run, title="GPT-3 175B (4 of 96 layers), FSDP, rank 0 of 512, DGX A100")

# %% [markdown]
# Communication is almost all hidden: each unit's all-gather runs while the previous unit computes (on the
# timeline, a pass's units are one colour, each bar named). The H100 cluster's step is shorter by about its
# faster compute, which is most of its step.
#
# Read each step with the `trust:` line under it: how predictions on that preset have fared against published
# training runs that priced nothing in it (`toolkit.sim.held_to_runs`). On the A100 the runs took at most a sixth
# longer than the predicted step; on the H100, the FSDP runs took a fifth or more longer than predicted: their
# compute ran slower than the benchmarks the H100 is priced from (docs/differences.md, "The H100 gap"). So read the
# H100's step as what its kernels' benchmarks allow, a bound the runs have not reached.
#
# The prediction is *above* what the paper measured. The cost model prices each kernel at the rate published
# measurements of the A100 give its shape (cuBLAS's GEMMs, FlashAttention-2, STREAM's bandwidth), the collectives
# at nccl-tests' bus bandwidth and the network cards' measured rate, and compute slowed while NCCL's kernels
# share the SMs; each with the spread of its sources (the band printed with the step). But this GPT calls one
# fused attention kernel (FlashAttention), where the paper's minGPT wrote its attention out: the (heads, s, s)
# scores in memory, read and written several times. `tests/test_sim_papers.py` prices minGPT's own kernels on the
# paper's cluster, which brings the prediction into the paper's band; `docs/differences.md` says what the model
# leaves out. So a simulated rate is what *this* code would reach on that hardware; compare strategies with it
# (as below), and compare it with a paper only with the paper's own kernels.
#
# Open the timeline in Perfetto:
# `toolkit.trace.chrome.save_chrome(gpt3_sim.modelled_run, "gpt3.json")`, then ui.perfetto.dev.
#
# ### Where does each strategy stop fitting, or stop scaling?
#
# ZeRO's 7.5B model, one sequence of 1024 tokens per GPU, on 8 and on 1024 GPUs: plain data parallelism,
# ZeRO-3, FSDP with prefetching and HSDP (FSDP sharded inside each 8-GPU node). `toolkit.sim.sweep` simulates
# 3 and 4 layers and extrapolates time and memory to all 36 (a few seconds per case: add world sizes to see
# more). What each strategy does is printed under the figure, from its numbers.

# %%
from toolkit.sim.sweep import describe, sweep  # noqa: E402

WORLDS = (8, 1024)
STRATEGIES = {
    "ddp": {},
    "zero3": {},
    "fsdp": dict(forward_prefetch=True),
    "hsdp": ("fsdp", dict(sharding_group_size=8, forward_prefetch=True)),
}
scaling_rows = sweep(
    presets.zero_7_5b,
    layers=36,
    strategies=STRATEGIES,
    worlds=WORLDS,
    cluster="dgx-a100",
    mixed_precision=True,
    seq_len=1024,
)
for line in describe(scaling_rows):
    print(line)
toolkit.viz.scaling(scaling_rows, title="ZeRO's 7.5B model on DGX A100 nodes")

# %% [markdown]
# Plain data parallelism never fits: its 120 GB of model states per GPU do not shrink as GPUs are added (lesson
# 03). ZeRO-3, one module at a time, waits for every all-gather: it pays the network on every layer and loses
# most of its rate as the rings grow. FSDP prefetches: at 8 GPUs its gathers hide behind compute, and across 128
# nodes (eight network cards per node, each at its measured rate in NCCL) they still mostly do: it keeps its
# rate. HSDP keeps the gathers inside a node; only its all-reduce over the replicas crosses the network, behind
# the next units' backward (as torch's FSDP runs it). What it pays instead is memory and compute: a replica holds
# and updates 1/8 of the model where a fully sharded rank holds 1/1024, so its optimizer step is over a hundred
# times FSDP's, and on the DGX's network it keeps less of its rate than FSDP does. On a slower network the
# balance tips toward HSDP, the FSDP paper's finding (try `cluster=` with a custom preset; `tests/test_sim_papers.py`
# checks it at a tenth of the paper's network). The cell below checks each sentence of this paragraph about the
# numbers above against them.

# %%
at = {(r["label"], r["world_size"]): r for r in scaling_rows}
change = {
    k: at[k, WORLDS[-1]]["tflops_per_gpu"] / at[k, WORLDS[0]]["tflops_per_gpu"] - 1 for k in STRATEGIES if k != "ddp"
}
assert not any(at["ddp", w]["fits"] for w in WORLDS) and at["ddp", WORLDS[0]]["states"] > 100 * GB
assert change["zero3"] < -0.5 and change["zero3"] < change["fsdp"] and abs(change["fsdp"]) < 0.1
assert at["fsdp", 8]["breakdown"]["exposed_comm"] < 0.1 * at["fsdp", 8]["step_time"]
assert at["fsdp", 1024]["breakdown"]["exposed_comm"] < 0.2 * at["fsdp", 1024]["step_time"]
assert change["hsdp"] < change["fsdp"] and at["hsdp", 1024]["tflops_per_gpu"] < at["fsdp", 1024]["tflops_per_gpu"]
assert at["hsdp", 1024]["states"] > at["fsdp", 1024]["states"]
assert at["hsdp", 1024]["breakdown"]["optimizer"] > 100 * at["fsdp", 1024]["breakdown"]["optimizer"]
print({k: f"{v:+.0%}" for k, v in change.items()})

# %% [markdown]
# ### The same question for experts
#
# 64 experts on 64 GPUs (MoE-GPT-S's width, one block, no token dropped), half of the tokens routed to
# expert 0: the rank that holds it computes most of the rows, and every rank waits for it. Shadowing copies
# expert 0 to every rank (a broadcast of its weights, and an all-reduce of their gradients) so each
# computes its own rows.


# %%
def hot_expert(num_tokens, num_experts, top_k):
    t = torch.arange(num_tokens)
    first = torch.where(t % 2 == 0, torch.zeros_like(t), t % num_experts)
    return torch.stack([first] + [(first + 1 + t % (num_experts - 1)) % num_experts for _ in range(top_k - 1)], 1)


RATES = dict(compute_flops=312e12 * 0.52, bandwidth=25e9)  # the shadowing predictor's P and W_net: the cluster's
experts = {}
for label, moe_options in (
    ("plain", {}),
    ("shadow expert 0", dict(shadow=[0], **RATES)),
    ("pipeline 4", {"pipeline_degree": 4}),
):
    experts[label] = simulate(
        lambda o=moe_options: presets.moe_gpt_64(n_layer=1, moe_options=dict(o, dropless=True)),
        "ddp",
        64,
        routing=hot_expert,
        progress=False,
        mixed_precision=True,
        cluster="dgx-a100",
    )
    print(f"{label:<16} {experts[label].cost.summary()}\n")
plain, shadow, pipelined = experts.values()
assert shadow.step_time < plain.step_time <= pipelined.step_time  # the sentences below
faster = plain.step_time / shadow.step_time  # the cluster's useful rate rises by as much; rank 0's own falls
assert (
    abs(shadow.tflops_per_gpu / plain.tflops_per_gpu / faster - 1) < 1e-6
    and shadow.cost.rank_tflops < plain.cost.rank_tflops
)
print(
    f"shadowing: a {faster:.1f}x shorter step, {plain.tflops_per_gpu:.3g} -> {shadow.tflops_per_gpu:.3g} TFLOP/s per GPU "
    f"(rank 0's own: {plain.cost.rank_tflops:.3g} -> {shadow.cost.rank_tflops:.3g})"
)

# %% [markdown]
# Shadowing pays here: the hot rank's compute is spread, for one expert's weights on the network, and the
# cluster's useful rate (all ranks' work per GPU) rises by as much as the step shortens, while rank 0's own rate
# falls: it no longer computes most of expert 0's rows. Tutel's
# pipelining (4 chunks) does not: each chunk's all-to-all pays the latency of 63 messages, and there is
# little expert compute per chunk to hide it behind (`tests/test_sim_papers.py` shows the degree that wins
# growing as the network slows). The lab, `labs/10-cost-model`, has you write the two rules this part
# rests on: the alpha-beta times of the ring's collectives and the overlap rule.

# %% [markdown]
# ## 3. FSDP or 3D? GPT-3 175B on 1,024 A100s
#
# The two papers answer the same question differently. The FSDP paper shards everything over every GPU and
# hides the gathers behind compute (173-186 TFLOP/s per GPU on up to 512 A100s). Megatron-LM (Narayanan et
# al., SC21) keeps tensor parallelism inside a node, pipelines the layers across nodes and runs data
# parallelism over what is left: 140 TFLOP/s per GPU for GPT-3 175B on 1,024 A100s. Here are both, and a
# hybrid, on one simulated cluster of 128 DGX A100 nodes, with the same work: a global batch of 1,024
# sequences of 2,048 tokens (2M tokens, GPT-3's order of magnitude), bf16, every block recomputed in backward.
#
# - **FSDP**: fully sharded over all 1,024 GPUs, one sequence each, prefetching;
# - **HSDP**: sharded over 16 nodes (128 GPUs), replicated 8 times (sharded over one node, part 1 showed,
#   GPT-3's model states do not fit);
# - **3D** as Megatron-LM lays it out: tp 8 inside each node, pp 8 stages across nodes, ZeRO-1 over the 16
#   replicas (Megatron's distributed optimizer), 1F1B with 64 micro-batches of one sequence.
#
# A pipelined rank's step is no longer its own: stage s waits for stage s-1's activations and stage s+1's
# gradients. So the simulator runs the pipeline's own code for a rank of each kind of stage (the first with
# the embedding, a middle one, the last with the head and the loss), puts every stage's program together in
# the order of the schedule's action lists, and replays them on one clock: the step is the critical path
# across the stages, the idle time of a stage its bubble, each transfer on the link between the two nodes
# (`toolkit.sim.pipelined`). One and two blocks per stage are simulated and extrapolated to twelve, as the
# sweep above extrapolates layers.

# %%
import functools  # noqa: E402

from toolkit.sim.sweep import PIPELINE_BASE  # noqa: E402

GPT3_51K = functools.partial(presets.gpt3_175b, vocab_size=51200)  # Megatron-LM's padded vocabulary
CHECKPOINTING = dict(mixed_precision=True, activation_checkpointing=True, cluster="dgx-a100", progress=False)
LAYOUTS = {  # label -> (strategy over dp, its options, tp x pp): 1,024 sequences in each
    "FSDP": ("fsdp", dict(forward_prefetch=True), 1),
    "HSDP, shard 128": ("fsdp", dict(forward_prefetch=True, sharding_group_size=128), 1),
    "3D: tp 8, pp 8, dp 16": ("zero1", dict(tp=8, pp=8, microbatches=64), 64),
}


def layout_row(label, strategy, options, per_replica, world=1024):
    """Simulate a layout's blocks at two depths and extrapolate to GPT-3's 96 (per stage under pp)."""
    stages = options.get("pp", 1) * options.get("virtual_stages", 1)
    at = PIPELINE_BASE if stages > 1 else BASE
    sims = [
        simulate(
            lambda n=n: GPT3_51K(n_layer=n * stages),
            strategy,
            world,
            batch_per_rank=per_replica,
            **options,
            **CHECKPOINTING,
        )
        for n in at
    ]
    return dict(extrapolate(*sims, 96 // stages, at), label=label, sim=sims[-1])


gpt3_layouts = {label: layout_row(label, *spec) for label, spec in LAYOUTS.items()}
WORDS = {"compute": "compute", "exposed_comm": "exposed communication", "bubble": "bubble", "p2p": "point-to-point"}
for label, r in gpt3_layouts.items():
    b = r["breakdown"]
    parts = {WORDS[k]: b[k] for k in WORDS if b.get(k, 0.0) > 0}
    waiting = {k: v for k, v in parts.items() if k != "compute"}
    print(
        f"{label:<22} peak {bytes_text(r['peak']):>8} per GPU (model states {bytes_text(r['states']):>8}): "
        f"{'fits' if r['fits'] else 'DOES NOT FIT'}; step {seconds_text(b['step'])} = "
        + " + ".join(f"{k} {seconds_text(v)}" for k, v in parts.items())
        + f"; {r['tflops_per_gpu']:.0f} TFLOP/s per GPU, MFU {r['mfu']:.0%}; besides compute, "
        f"{max(waiting, key=waiting.get)} dominates"
    )

# %%
import plotly.graph_objects as go  # noqa: E402

from toolkit.viz import style  # noqa: E402

PARTS = {
    "compute": style.COMPUTE["forward"],
    "exposed_comm": style.COMMUNICATION["all_reduce"],
    "bubble": style.COMPUTE["wait"],
    "p2p": style.COMMUNICATION["send"],
}


def layout_figure(rows):
    """The step of each layout, split into what its compute stream did: compute, waiting for its collectives,
    for another stage (the bubble), for a transfer on the wire."""
    fig = go.Figure(
        [
            go.Bar(
                name=part,
                x=[r["label"] for r in rows],
                y=[r["breakdown"].get(part, 0.0) for r in rows],
                marker_color=colour,
            )
            for part, colour in PARTS.items()
        ]
    )
    style.place_title(
        fig,
        "GPT-3 175B, 1,024 sequences per step on 1,024 A100s",
        "one step of rank 0, by what its compute stream did (modelled)",
    )
    fig.update_layout(barmode="stack", yaxis_title="seconds per step", template="plotly_white", height=420)
    return fig


layout_figure(list(gpt3_layouts.values()))

# %% [markdown]
# Read the bars. FSDP's communication is almost all hidden: each unit's gather runs while the previous one
# computes, so its step is its compute, and with one sequence per GPU nothing else is left to wait for. The 3D
# layout computes the same FLOPs per GPU but waits: for other stages (the bubble: more than the formula's
# (p-1)/(m+p-1) = 7/71 = 10% of the step, because the last stage also computes the head and the loss, and
# every other stage waits for it), and for its tensor-parallel all-reduces, in every block's forward (the
# recomputed one too) and backward, on the critical path by construction: more than for its transfers
# between stages. What 3D buys is memory: its peak is about four fifths of FSDP's, which gathers a whole layer
# of GPT-3 at a time and keeps a sequence's checkpoints for all 96 layers (a 3D rank keeps twelve layers'
# checkpoints, of up to eight micro-batches in flight, and its sharded layers never gather). HSDP pays for its replicas in memory
# (8 times FSDP's model states) and matches FSDP's step here: its all-reduce across the replicas hides
# behind backward as well.
#
# So on these numbers FSDP is the fastest at 1,024 GPUs, by the cost model's reckoning (an upper bound for
# every layout: `docs/differences.md`; Megatron-LM measured 140 TFLOP/s per GPU for GPT-3 on 1,024 A100s,
# with its own batch and layout). Where 3D is the answer: when the batch is smaller than the cluster (FSDP needs a
# sequence per GPU), when the network is slower (FSDP's gathers cross it every layer; 3D sends one
# activation per micro-batch per stage), and when the model is larger (a layer of a 1T-parameter model does
# not fit a GPU to gather). The cell below checks each sentence against the numbers above.

# %%
fsdp, hsdp, three_d = gpt3_layouts.values()
assert all(r["fits"] for r in (fsdp, hsdp, three_d))
assert fsdp["breakdown"]["exposed_comm"] < 0.05 * fsdp["breakdown"]["step"]  # "almost all hidden"
assert abs(three_d["useful_flops"] / fsdp["useful_flops"] - 1) < 0.05  # "the same FLOPs"
bubble_share, formula = three_d["breakdown"]["bubble"] / three_d["breakdown"]["step"], 7 / 71
assert bubble_share > formula and round(100 * formula) == 10  # "more than 10%"
stages = three_d["sim"].cost.stages[-1]
computed = {r: t.compute for r, t in stages.stages.items()}
assert max(computed, key=computed.get) == max(computed)  # the last stage computes most
assert three_d["breakdown"]["exposed_comm"] > three_d["breakdown"]["p2p"]  # tp all-reduces, not transfers
assert 0.75 < three_d["peak"] / fsdp["peak"] < 0.85  # "about four fifths of FSDP's"
assert abs(hsdp["states"] / fsdp["states"] - 8) < 0.1  # "8 times the model states"
assert abs(hsdp["breakdown"]["step"] / fsdp["breakdown"]["step"] - 1) < 0.05  # "matches FSDP's step"
assert fsdp["tflops_per_gpu"] > hsdp["tflops_per_gpu"] * 0.99 and fsdp["tflops_per_gpu"] > three_d["tflops_per_gpu"]
print(
    f"bubble {bubble_share:.0%} of the 3D step (formula {formula:.0%}); each stage's compute with 2 blocks per "
    f"stage (the simulation extrapolated from): " + ", ".join(seconds_text(c) for c in computed.values())
)

# %% [markdown]
# ### Try it: move the layout
#
# Pick tensor- and pipeline-parallel sizes, the data-parallel strategy over what is left, the micro-batches and
# the schedule, then "simulate": the panel adds that layout, on the same 1,024 A100s and 1,024 sequences, to the
# figure (seconds for a layout without pp; longer with it, whose kinds of stage are simulated one by one). Things to try: pp 16 with 64 micro-batches
# (a longer pipeline, a bigger bubble), the interleaved schedule (2 virtual stages: the bubble halves, twice the
# transfers), tp 16 (a tensor-parallel group across two nodes: the cliff of lesson 08), fsdp with tp 8 (2D).

# %%
import ipywidgets as widgets  # noqa: E402
from IPython.display import display  # noqa: E402

controls = dict(
    tp=widgets.Dropdown(options=[1, 2, 4, 8, 16], value=8, description="tp"),
    pp=widgets.Dropdown(options=[1, 2, 4, 8, 16], value=16, description="pp"),
    strategy=widgets.Dropdown(options=["zero1", "ddp", "fsdp"], value="zero1", description="dp strategy"),
    microbatches=widgets.Dropdown(options=[16, 32, 64, 128], value=64, description="micro-batches"),
    schedule=widgets.Dropdown(options=["1f1b", "interleaved"], value="1f1b", description="schedule"),
)
go_button, said, drawn = widgets.Button(description="simulate"), widgets.Output(), widgets.Output()
tried: list = []  # the layouts simulated from the panel, drawn beside the three above
with drawn:
    display(layout_figure(list(gpt3_layouts.values())))


def simulate_layout(_=None):
    c = {k: w.value for k, w in controls.items()}
    tp, pp = c["tp"], c["pp"]
    options = dict(tp=tp) if tp > 1 else {}
    if pp > 1:
        options.update(
            pp=pp,
            microbatches=c["microbatches"],
            schedule=c["schedule"],
            **({"virtual_stages": 2} if c["schedule"] == "interleaved" else {}),
        )
    if c["strategy"] == "fsdp":
        options["forward_prefetch"] = True
    label = f"{c['strategy']}, tp {tp}, pp {pp}" + (f", {c['schedule']} m {c['microbatches']}" if pp > 1 else "")
    with said:
        said.clear_output()
        try:
            row = layout_row(label, c["strategy"], options, 1024 * tp * pp // 1024)
        except ValueError as error:  # a layout that cannot be: say why, as the toolkit does
            print(error)
            return
        print(
            f"{label}: peak {bytes_text(row['peak'])} per GPU ({'fits' if row['fits'] else 'does NOT fit'}), "
            f"step {row['breakdown']['step']:.2f} s, {row['tflops_per_gpu']:.0f} TFLOP/s per GPU"
        )
    tried.append(row)
    with drawn:
        drawn.clear_output(wait=True)
        display(layout_figure(list(gpt3_layouts.values()) + tried))


go_button.on_click(simulate_layout)
display(
    widgets.VBox(
        [
            widgets.HBox(list(controls.values())[:3]),
            widgets.HBox(list(controls.values())[3:] + [go_button]),
            said,
            drawn,
        ]
    )
)
