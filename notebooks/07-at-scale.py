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
from toolkit.sim import Collective, Compute, Wait, simulate

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
        print(f"  collective  {instruction.op:<15} {instruction.size_bytes:>8,} B  {instruction.phase:<9} "
              f"for {instruction.label}")
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
rows = []
for strategy, stage in (("ddp", 0), ("zero1", 1), ("zero2", 2), ("zero3", 3)):
    s = simulate(presets.zero_7_5b, strategy, 64, seq_len=128, warmup=False, progress=False,
                 mixed_precision=True)
    rows.append({"strategy": strategy, "simulated GB per rank": round(s.memory["total"] / GB, 3),
                 "formula GB": round(model_states(s.num_params, 64, stage) / GB, 3),
                 "paper GB": {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}[stage]})
print(f"{s.num_params / 1e9:.2f}B parameters")
for row in rows:
    print(row)

# %% [markdown]
# The strategies' tensors agree with (2 + 2 + 12)Ψ to a few bytes: the padding that makes every flat
# buffer split evenly over 64 ranks (at most 63 elements per buffer), and Adam's 4-byte step counters.
#
# ### GPT-3 175B on 512 GPUs
#
# The FSDP paper trains GPT-3 175B (96 layers, d_model 12288) on up to 512 A100s. Each rank keeps
# (2+2+12)Ψ/512 = 5.5 GB of model states, and every step moves the 16-bit model three times (gather in
# forward, gather in backward, reduce-scatter): 3·2Ψ·(N-1)/N = 1 TB sent per rank. With hybrid sharding
# (shard inside each 8-GPU node, replicate across nodes) only a gradient all-reduce of the node's shard
# leaves the node: 2M(W-1)/(GW) instead of 3M(W-1)/W.
#
# The full 96 layers take about 15 s per strategy (`python -m toolkit simulate --model gpt3-175b`, or
# `bench/sim_speed.py`). Per-rank memory and bytes grow layer by layer, so 4 layers at the full width show
# every effect in a second; the formulas are evaluated for the model that was simulated.

# %%
gpt3 = lambda: presets.gpt3_175b(n_layer=4)  # noqa: E731 - the full width, 4 of its 96 layers
for strategy, options in (("zero3", {}), ("fsdp", {}), ("fsdp", {"sharding_group_size": 8})):
    s = simulate(gpt3, strategy, 512, progress=False, mixed_precision=True, **options)
    name = strategy + (" (hybrid)" if options else "")
    M, F = 2 * s.num_params, options.get("sharding_group_size", 512)  # the 16-bit model; the sharding factor
    print(f"{name:<14} states {s.memory['total'] / GB:6.2f} GB (formula {16 * s.num_params / F / GB:6.2f})"
          f"   peak {s.peak / GB:5.1f} GB in {s.peak_moment['pass']} at {s.peak_moment['module']}"
          f"   sent {s.bytes_per_step['total'] / GB:6.1f} GB, across nodes {s.cross_node_bytes / GB:6.2f} GB"
          f" (paper: {formulas.fsdp_cross_host_traffic(M, 8, 512, 'hybrid' if options else 'full_shard') / GB:6.2f})")

# %% [markdown]
# Read the peaks: model states are tiny per rank, yet the peak is many gigabytes. It is made of what
# the step holds at one moment: the gathered units (FSDP: the unit computing, the next one prefetched,
# and the root unit with the embeddings, needed first and last in backward), the activations of a
# 2048-token sequence, and the gradients on their way to a reduce-scatter. `sim.peak_memory` says which.
#
# ### Try it
#
# Pick a model, a strategy and a cluster; the simulated rank's memory at its peak is drawn per category
# next to the formula's model states. Big models take a few seconds per simulated layer group: lower the
# layers to see the effect quickly (per-rank numbers scale with them).

# %%
import ipywidgets as widgets  # noqa: E402
from IPython.display import display  # noqa: E402

from toolkit.sim.cli import write_report  # noqa: E402,F401 - the same report the command line writes

MODELS = {"GPT-3 175B": presets.gpt3_175b, "ZeRO 7.5B": presets.zero_7_5b, "GPT-2 XL": presets.gpt2_xl,
          "MoE-GPT-S (16 experts)": presets.moe_gpt_s}


def show(model="GPT-3 175B", strategy="fsdp", world_size=512, layers=2, hybrid=False):
    build = MODELS[model]
    options = {"mixed_precision": True}
    if hybrid and strategy == "fsdp":
        options["sharding_group_size"] = min(8, world_size)
    if "MoE" in model and strategy not in ("ddp", "dp"):
        print("MoE models train their dense part with 'ddp' (experts are expert-parallel): choose ddp.")
        return None
    s = simulate(lambda: build(n_layer=layers), strategy, world_size, progress=False, **options)
    print(s.summary())
    return toolkit.viz.memory_bars({strategy: s.run}, {strategy: s.theory()["model_states_total"]}, unit=GB,
                                   title=f"{model} ({layers} layers), {strategy}, rank 0 of {world_size}")


controls = widgets.interactive(
    show, {"manual": True, "manual_name": "simulate"}, model=list(MODELS),
    strategy=["ddp", "zero1", "zero2", "zero3", "fsdp"], world_size=[8, 64, 128, 256, 512, 1024],
    layers=widgets.IntSlider(2, 1, 12), hybrid=False)
display(controls)
show()  # the default, so that the figure is there before you touch anything

# %% [markdown]
# ## 2. How long would a step take?
#
# Everything above is sizes: bytes and FLOPs. Each `Simulation` also holds `programs`, the step in the
# order the rank issued it (compute, collective, wait). The cost model (`toolkit.sim.cost`) turns that
# into time on a cluster with three rules:
#
# - **compute**: a segment's FLOPs at an *achievable* fraction of the accelerator's peak (Megatron-LM
#   measured 52% on A100, 163 of 312 TFLOP/s), or its bytes at the memory's bandwidth when that is slower;
# - **communication**: the alpha-beta model of the links a collective crosses: NVLink inside a node,
#   one network card per GPU between nodes (a ring across nodes uses all 8 cards of a node at once; a
#   group with one GPU per node, like HSDP's replicas, gets one card);
# - **overlap**: a collective starts when the compute issued before it is done and its link is free; the
#   compute stream stalls only at a `Wait`. That is why buckets and prefetching pay.
#
# `simulate(..., cluster=...)` fills `sim.step_time`, `sim.breakdown` (compute, exposed and overlapped
# communication), `sim.tflops_per_gpu`, `sim.mfu` and `sim.modelled_run`, a Run with the same spans as a
# real trace. The presets, each with its sources:

# %%
from toolkit.sim import price  # noqa: E402
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
predicted = simulate(lambda: tiny_gpt(vocab_size=128, seq_len=64, **MODEL), "fsdp", 2, batch_per_rank=8,
                     progress=False, cluster=machine)
real = launch_train(TrainConfig(strategy="fsdp", steps=5, global_batch_size=16, model=MODEL, vocab_size=128,
                                seq_len=64, progress=False, sample_memory=False), world_size=2)
slowest = {}  # step -> the slowest rank's time: a step is done when its last rank is
for r in real.ranks:
    for step, seconds in real.metric("step_time", rank=r):
        slowest[step] = max(slowest.get(step, 0.0), seconds)
measured = sorted(slowest[step] for step in range(1, 5))[2]
print(f"predicted {predicted.step_time * 1e3:.1f} ms, measured {measured * 1e3:.1f} ms (slowest rank, median of "
      f"the last 4 steps): error {predicted.step_time / measured - 1:+.0%}")
print(predicted.cost.summary())

# %% [markdown]
# On a quiet machine most predictions land within 20% (`docs/benchmarks.md`, "Simulator accuracy", holds
# the numbers for every strategy); under load from other work, errors of 10-50% are usual. Two things the
# calibration measures make that possible on a CPU: a collective's cost as a step pays it (compute between
# calls, the mean with its slow tail, not back-to-back calls), and how little of it hides behind compute
# (`machine.overlap`: gloo's threads copy on the cores the ranks compute on, so prefetching buys little
# here, unlike on a GPU). The published simulators (vTrain, ASTRA-sim) reach 8-20% on GPU clusters.
# Compare the two timelines: the same spans in the same order, measured above, modelled below.

# %%
start, end = toolkit.trace.analysis.step_windows(real, 0)[3]
toolkit.viz.timeline(real, ranks=[0], where=lambda e: start <= e["start"] < end,
                     title="measured: rank 0, step 3").show()
toolkit.viz.timeline(predicted.modelled_run, title="modelled: rank 0 of 2, one step")

# %% [markdown]
# ### GPT-3 175B on 512 A100s
#
# The FSDP paper reports 173-186 TFLOP/s per GPU for GPT-3 175B on 128 to 512 A100s. Its configuration:
# full sharding, bf16, activation checkpointing, prefetching, one 2048-token sequence per GPU. Four of the
# 96 layers at the full width show the per-layer balance in a second (`tests/test_sim_papers.py` runs the
# whole model, within 15% of the paper).

# %%
gpt3_sim = simulate(lambda: presets.gpt3_175b(n_layer=4), "fsdp", 512, progress=False, mixed_precision=True,
                    activation_checkpointing=True, forward_prefetch=True, warmup=False, cluster="dgx-a100")
print(gpt3_sim.cost.summary())
print(price(gpt3_sim, "dgx-h100").summary())
toolkit.viz.timeline(gpt3_sim.modelled_run, title="GPT-3 175B (4 of 96 layers), FSDP, rank 0 of 512, DGX A100")

# %% [markdown]
# Communication is almost all hidden: each unit's all-gather runs while the previous unit computes. The
# whole step on the H100 cluster is about 3x faster, bounded by its compute. Open the timeline in Perfetto:
# `toolkit.trace.chrome.save_chrome(gpt3_sim.modelled_run, "gpt3.json")`, then ui.perfetto.dev.
#
# ### Where does each strategy stop fitting, or stop scaling?
#
# ZeRO's 7.5B model, one sequence of 1024 tokens per GPU, on 8 and on 1024 GPUs. Layers are identical, so
# `toolkit.sim.sweep` simulates 2 and 3 layers and extrapolates time and memory to all 36 (a few seconds
# per case: add world sizes and "ddp" to the lists to see more). A hollow marker means the rank's peak
# memory does not fit in the A100's 80 GB.

# %%
import plotly.graph_objects as go  # noqa: E402

from toolkit.sim.sweep import sweep  # noqa: E402

WORLDS = (8, 1024)
STRATEGIES = {"zero3": {}, "fsdp": dict(forward_prefetch=True),
              "hsdp": ("fsdp", dict(sharding_group_size=8, forward_prefetch=True))}
rows = sweep(presets.zero_7_5b, layers=36, strategies=STRATEGIES, worlds=WORLDS, cluster="dgx-a100",
             mixed_precision=True, seq_len=1024)
figure = go.Figure()
for label in STRATEGIES:
    mine = [r for r in rows if r["label"] == label]
    figure.add_trace(go.Scatter(
        x=[r["world_size"] for r in mine], y=[r["tflops_per_gpu"] for r in mine], name=label, mode="lines+markers",
        marker=dict(size=11, symbol=["circle" if r["fits"] else "circle-open" for r in mine]),
        hovertext=[f"{label} x{r['world_size']}: step {r['step_time'] * 1e3:.0f} ms, exposed communication "
                   f"{r['breakdown']['exposed_comm'] * 1e3:.0f} ms, peak {r['peak'] / GB:.0f} GB" for r in mine]))
figure.update_layout(xaxis=dict(type="log", title="GPUs"), yaxis_title="TFLOP/s per GPU", template="plotly_white",
                     title="ZeRO's 7.5B model on DGX A100 nodes (hollow: does not fit in 80 GB)")

# %% [markdown]
# Plain data parallelism never fits (120 GB of model states per GPU: lesson 03). ZeRO-3 one module at a time waits
# for every all-gather, so it pays the network on every layer and loses throughput as the rings grow;
# FSDP prefetches and keeps its rate. HSDP keeps the gathers inside a node; only its all-reduce over the
# replicas crosses the network, and it runs behind the next units' backward (as torch's FSDP runs it). What it
# pays instead is memory and the optimizer step: a replica holds 1/8 of the model, so its step is 64x a fully
# sharded rank's at 512 GPUs. On a slower network than the DGX's the balance tips toward HSDP (the FSDP paper's
# finding): try `cluster=` with a custom preset.
#
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


for label, moe_options in (("plain", {}), ("shadow expert 0", {"shadow": [0]}), ("pipeline 4", {"pipeline_degree": 4})):
    moe_options["dropless"] = True
    s = simulate(lambda: presets.moe_gpt_64(n_layer=1, moe_options=moe_options), "ddp", 64, routing=hot_expert,
                 progress=False, mixed_precision=True, warmup=False, cluster="dgx-a100")
    print(f"{label:<16} {s.cost.summary()}")

# %% [markdown]
# Shadowing pays here: the hot rank's compute is spread, for one expert's weights on the network. Tutel's
# pipelining (4 chunks) does not: each chunk's all-to-all pays the latency of 63 messages, and there is
# little expert compute per chunk to hide it behind (`tests/test_sim_papers.py` shows the degree that wins
# growing as the network slows). The lab, `labs/10-cost-model`, has you write the two rules this part
# rests on: the alpha-beta times of the ring's collectives and the overlap rule.
