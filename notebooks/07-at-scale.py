# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
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
    M = 2 * s.num_params
    print(f"{name:<14} states {s.memory['total'] / GB:6.2f} GB (formula {16 * s.num_params / (options.get('sharding_group_size') or 512) / GB:6.2f})"
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
# *Part 2 of this lesson (the cost model) follows here.* Everything above is sizes: bytes and FLOPs.
# Each `Simulation` also holds `programs`, the step in the order the rank issued it (compute, collective,
# wait), which is what a cost model needs to turn sizes into time on a given cluster.
