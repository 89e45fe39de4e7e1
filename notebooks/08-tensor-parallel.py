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
# # 08 · Tensor parallelism: Megatron's split layers, sequence parallelism, and 2D with FSDP
#
# Every strategy so far was *data* parallel: each rank runs the whole model on its own slice of the
# batch, and ZeRO/FSDP only change where the model states wait between uses. **Model parallelism** splits
# the computation of one sequence itself. The course asks two questions of it, and one of FSDP:
# *compute efficiency? memory efficiency?* and *what is the difference between FSDP and tensor
# parallelism?* This notebook answers them with measurements.
#
# **Tensor parallelism** (Shoeybi et al. 2019, Megatron-LM) cuts each weight matrix over t ranks, which
# then compute one layer together and talk inside it. The code is `toolkit/parallel/tensor/`, one idea per
# file (`operators.py` first). The plan:
#
# 1. **f and g**: a column-parallel then row-parallel MLP on 2 ranks equals the whole MLP, with one
#    all-reduce forward and one backward;
# 2. **tensor parallelism against FSDP on the same 2 ranks**: memory per rank and bytes per layer, measured
#    next to the formulas;
# 3. **the two timelines side by side**: where the bytes go, and whether anything hides them;
# 4. **sequence parallelism** (Korthikanti et al. 2022): the layer norms split too, the activations /t; and
#    their selective recomputation, the attention's scores recomputed rather than stored;
# 5. **2D at 512-1,024 GPUs** in the simulator: when does FSDP + TP beat FSDP alone, and the cliff when a
#    tensor-parallel group leaves its node.
#
# It runs top to bottom in about a minute on a 2-core laptop. Then do `labs/11-tensor-parallel`: you
# write f, g and a column/row-parallel MLP.

# %%
import functools

import torch

import toolkit
from toolkit.memory import (
    activation_terms,
    activations_by_module,
    communication_per_step,
    gpt_parameter_split,
    model_states_breakdown,
    tp_activation_terms,
    tp_bytes_per_layer,
    tp_bytes_per_step,
    tp_model_states,
)
from toolkit.models import SyntheticCorpus, presets, tiny_gpt
from toolkit.run import Run
from toolkit.sim import simulate
from toolkit.train import TrainConfig, train

KB = 1e3

# %% [markdown]
# ## 1. f and g: the only places the ranks talk
#
# An MLP is `Y = GELU(X A) B`. Cut A by **columns** over t ranks: rank r computes `GELU(X A_r)`, its own
# slice of the hidden units, from the whole X, with no talk (GELU acts on each hidden unit alone). Cut B by
# **rows**: rank r multiplies its hidden slice by its rows `B_r` and gets a *partial sum* of Y. Two
# operators make it exact:
#
# | | forward | backward |
# |---|---|---|
# | **f** (before the column layer) | identity | all-reduce the gradient of X (each rank's is partial) |
# | **g** (after the row layer) | all-reduce the partial sums | identity |
#
# The row layer's bias is added once, after g. Below, the split MLP on 2 ranks against the whole MLP,
# forward and backward, and the collectives it issued.

# %%
MODEL = dict(n_layer=2, d_model=64, n_head=4)  # the same tiny GPT everywhere below
SEQ, ROWS = 32, 4  # tokens per sequence; sequences per step (the global batch)


def split_mlp_check():
    """A column-then-row MLP on this rank's halves against the whole MLP on every rank."""
    import torch.distributed as dist

    from toolkit.models.gpt import MLP, GPTConfig
    from toolkit.parallel.tensor import TPGroup
    from toolkit.parallel.tensor.linear import ColumnParallelLinear, RowParallelLinear
    from toolkit.trace.events import recorder

    torch.manual_seed(0)
    whole = MLP(GPTConfig(d_model=64))
    torch.nn.init.normal_(whole.proj.bias)  # a bias that is not zero: added once, or the check fails
    x = torch.randn(ROWS, SEQ, 64, requires_grad=True)
    whole(x).sum().backward()
    expected, expected_dx = whole(x).detach(), x.grad.clone()
    tp, done = TPGroup.of(dist.group.WORLD), {}
    split = torch.nn.Sequential(
        ColumnParallelLinear(whole.fc, tp, done, "fc"), torch.nn.GELU(), RowParallelLinear(whole.proj, tp, done, "proj")
    )
    x.grad = None
    recorder.reset()
    y = split(x)
    y.sum().backward()
    calls = [
        (e["phase"] if e["phase"] != "idle" else "", e["name"], e["args"].get("tp"))
        for e in recorder.events
        if e["cat"] == "comm"
    ]
    return {
        "out": (y - expected).abs().max().item(),
        "dx": (x.grad - expected_dx).abs().max().item(),
        "calls": calls,
        "fc": tuple(split[0].weight.shape),
        "proj": tuple(split[2].weight.shape),
    }


CONFIGS = {  # one global batch of ROWS sequences, on 2 ranks each way
    "fsdp": TrainConfig(strategy="fsdp", steps=3, global_batch_size=ROWS, seq_len=SEQ, model=MODEL, progress=False),
    "tp": TrainConfig(
        strategy="local", steps=3, global_batch_size=ROWS, seq_len=SEQ, model=MODEL, progress=False, options={"tp": 2}
    ),
    "tp+sp": TrainConfig(
        strategy="local",
        steps=3,
        global_batch_size=ROWS,
        seq_len=SEQ,
        model=MODEL,
        progress=False,
        options={"tp": 2, "sequence_parallel": True},
    ),
}


def per_block_activations(config):
    """Bytes autograd keeps per block on this rank for one forward of the wrapped model."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model, _ = toolkit.parallel.wrap(tiny_gpt(seq_len=SEQ, **MODEL), config.strategy, **config.options)
    dp, dp_rank = config.data_parallel(dist.get_world_size(), dist.get_rank())
    x, y = SyntheticCorpus(64, SEQ).batch(0, ROWS, rank=dp_rank, world_size=dp)
    return activations_by_module(model, model.module.blocks, x, y)[0]


def lesson():
    return {
        "mlp": split_mlp_check(),
        "runs": {k: train(c) for k, c in CONFIGS.items()},
        "activations": {k: per_block_activations(c) for k, c in CONFIGS.items()},
    }


ranks = toolkit.launch(lesson, 2, timeout_s=300)
runs = {k: Run.merge(r["runs"][k] for r in ranks) for k in CONFIGS}
mlp = ranks[0]["mlp"]
print(f"rank 0 holds fc {mlp['fc']} of (256, 64) and proj {mlp['proj']} of (64, 256)")
print(f"largest difference from the whole MLP: output {mlp['out']:.1e}, input gradient {mlp['dx']:.1e}")
for _phase, name, operator in mlp["calls"]:
    print(f"  {name:<11} {operator}")
assert [c[2] for c in mlp["calls"]] == ["g forward", "f backward"] and mlp["out"] < 1e-5 and mlp["dx"] < 1e-5

# %% [markdown]
# The split MLP matches the whole one to fp32 rounding, and it talked exactly twice: g's all-reduce in
# forward, f's in backward. Attention is cut the same way by heads (`attention.py`: the QKV projection
# column-parallel, each rank running its own heads, the output projection row-parallel), so **one
# transformer block costs two all-reduces of the (b, s, h) activation forward and two backward**. The
# token embedding and the head are cut by vocabulary, and the loss is computed on the split logits
# (`cross_entropy.py`: three all-reduces of one number per token), so no rank holds the full logits.
#
# ## 2. Tensor parallelism against FSDP on the same 2 ranks
#
# The same model and the same global batch, trained three steps by FSDP (each rank half the batch, the
# weights gathered unit by unit) and by tensor parallelism (each rank half of every large weight, the whole
# batch). First what each rank holds, measured by the ledger after a backward, against the formulas: FSDP
# keeps 1/N of everything (its fp32 shards: 4 + 4 + 8 bytes per parameter); tensor parallelism keeps
# Ψ_split/t + Ψ_rep (layer norms, position embeddings and the biases added after g stay whole).

# %%
counts = gpt_parameter_split(64, SEQ, MODEL["n_layer"], MODEL["d_model"])
psi = counts["split"] + counts["replicated"]
formula = {
    "fsdp": model_states_breakdown(psi, 2, 3, param_bytes=4, grad_bytes=4, optimizer_multiplier=8),
    "tp": tp_model_states(
        counts["split"], counts["replicated"], 2, 1, 0, param_bytes=4, grad_bytes=4, optimizer_multiplier=8
    ),
}
formula["tp+sp"] = formula["tp"]
s, b, h, a, L = SEQ, ROWS, MODEL["d_model"], MODEL["n_head"], MODEL["n_layer"]
switches = dict(bytes_per_value=4, dropout=False, fused_attention=True, small_terms=True)  # this GPT in fp32
formula_acts = {
    "fsdp": sum(activation_terms(s, b // 2, h, a, **switches).values()),
    "tp": sum(tp_activation_terms(s, b, h, a, 2, **switches).values()),
    "tp+sp": sum(tp_activation_terms(s, b, h, a, 2, sequence_parallel=True, **switches).values()),
}
print(f"Ψ = {psi:,} parameters: {counts['split']:,} split by tensor parallelism, {counts['replicated']:,} replicated")
print(f"{'per rank (KB)':<14}{'params':>16}{'grads':>16}{'optimizer':>16}{'activations/block':>22}")
measured = {}
for name, run in runs.items():
    after = [x for x in run.samples if x["rank"] == 0 and x["step"] == 2 and x["phase"] == "backward"][-1]
    measured[name] = {k: after[k] for k in ("params", "grads", "optimizer")}
    acts = ranks[0]["activations"][name][0]
    cells = [f"{measured[name][k] / KB:7.1f} ({formula[name][k] / KB:5.1f})" for k in ("params", "grads", "optimizer")]
    print(f"{name:<14}" + "".join(f"{c:>16}" for c in cells) + f"{acts / KB:12.1f} ({formula_acts[name] / KB:5.1f})")
    assert acts == formula_acts[name]
    assert all(abs(measured[name][k] - formula[name][k]) <= 4 * 28 + 16 for k in formula[name])  # step counters
print("(formula in parentheses; the optimizer adds a 4-byte step counter per tensor)")
assert sum(measured["fsdp"].values()) < sum(measured["tp"].values()) == sum(measured["tp+sp"].values())  # below
assert (
    formula_acts["tp+sp"] == sum(activation_terms(s, b, h, a, **switches).values()) / 2 < formula_acts["tp"]
)  # every term /t

# %% [markdown]
# Read the table row by row. **Model states**: FSDP's are the smaller, 1/N of everything, because FSDP
# shards the replicated parameters too and keeps no full copy between uses; a tensor-parallel rank holds
# its half of the split weights and *all* of the replicated ones, whole, all the time. **Activations**: each
# FSDP rank computes half the batch with whole layers; each tensor-parallel rank computes the whole batch
# with half of every split layer, so the activations inside the split layers (Q, K, V, attention, GELU)
# are halved but the layer norms' inputs and the inputs of the two column layers are kept whole, on both
# ranks (Korthikanti's s·b·h·(10 + 24/t) per layer). Sequence parallelism splits those too: every term /t.
# Every activation number matches `tp_activation_terms` to the byte (the assert above).
#
# **Bytes.** FSDP moves parameters: each unit all-gathered twice and reduce-scattered once, 3Ψ·(N-1)/N per
# step whatever the batch. Tensor parallelism moves activations: 4 all-reduces of b·s·h per block, plus
# the embedding's, the head's and the loss's, whatever the model's width, 2·(t-1)/t each.

# %%
from toolkit.trace.analysis import bytes_per_step, overlap_fraction  # noqa: E402

wire = {name: bytes_per_step(run, 0)[-1]["total"] for name, run in runs.items()}
theory = {
    "fsdp": communication_per_step(psi, 2, "fsdp") * 4,
    "tp": tp_bytes_per_step(b, s, h, L, 2)["total"],
    "tp+sp": tp_bytes_per_step(b, s, h, L, 2, sequence_parallel=True)["total"],
}
per_layer = {
    "fsdp": communication_per_step(12 * h * h + 13 * h, 2, "fsdp") * 4,
    "tp": tp_bytes_per_layer(b, s, h, 2, bytes_per_value=4),
    "tp+sp": tp_bytes_per_layer(b, s, h, 2, sequence_parallel=True, bytes_per_value=4),
}
for name in runs:
    print(
        f"{name:<6} sent {wire[name] / KB:6.1f} KB per step (formula {theory[name] / KB:6.1f}); "
        f"per layer {per_layer[name] / KB:5.1f} KB; hidden behind compute: {overlap_fraction(runs[name], 0):.0%}"
    )
assert overlap_fraction(runs["tp"], 0) == overlap_fraction(runs["tp+sp"], 0) == 0.0
assert wire["tp"] == theory["tp"] and wire["tp+sp"] == theory["tp+sp"] and abs(wire["fsdp"] - theory["fsdp"]) < 64

# %% [markdown]
# Measured and theory agree to the byte for tensor parallelism (FSDP's padding adds a few bytes). Per layer,
# tensor parallelism sends 4 all-reduces of b·s·h values, 8·(t-1)/t·b·s·h, against FSDP's 3·(N-1)/N·12h²
# (a layer has 12h² parameters): at t = N = 2 the ratio is b·s/(4.5·h), so **tensor parallelism moves fewer
# bytes when a replica's tokens are few compared with the width**, FSDP when they are many. For GPT-3
# (h = 12,288) with one 2,048-token sequence per GPU:

# %%
GPT3_H, GPT3_S = 12288, 2048
tp8 = tp_bytes_per_layer(1, GPT3_S, GPT3_H, 8)
fsdp8 = communication_per_step(12 * GPT3_H**2, 8, "fsdp") * 2
print(
    f"GPT-3 layer, bf16, one sequence per replica: tp=8 sends {tp8 / 1e6:.0f} MB per rank, FSDP over 8 ranks "
    f"{fsdp8 / 1e6:.0f} MB (with 8 sequences over the 8 ranks)"
)
assert fsdp8 > 10 * tp8

# %% [markdown]
# So FSDP moves far more bytes per layer for a wide model. Yet bytes are not the whole story: *when* they
# move decides the time.
#
# ## 3. The two timelines side by side
#
# Rank 0's last step under each, on the same time axis. FSDP's all-gathers and reduce-scatters run
# asynchronously: the next unit's gather is issued before this unit computes, the gradients' reduce-scatter
# while backward goes on, and the timeline shows them beside compute. Tensor parallelism's all-reduces are
# **in the middle of the layer's arithmetic**: the next matmul needs g's result, so every one of them
# stops compute (the fraction hidden printed above is 0% for both tensor-parallel runs).

# %%
figures = {}
for name in ("fsdp", "tp"):
    start, end = toolkit.trace.analysis.step_windows(runs[name], 0)[-1]
    figures[name] = toolkit.viz.timeline(
        runs[name],
        ranks=[0],
        where=lambda e, s=start, t=end: s <= e["start"] < t,
        title=f"{name}: rank 0, last step (2 ranks, {ROWS} sequences)",
    )
longest = max(max((d.base[i] + d.x[i]) for d in f.data for i in range(len(d.x))) for f in figures.values())
for fig in figures.values():
    fig.update_xaxes(range=[0, longest * 1.02])
figures["fsdp"].show()
figures["tp"]

# %% [markdown]
# On this CPU the collectives are loopback copies between processes, nothing like a cluster's links. For a
# GPU cluster the simulator runs the same code for one rank of a DGX A100 node (8 GPUs on NVLink), GPT-3's
# width, 2 layers, one 2,048-token sequence per data-parallel replica, and prices each collective on the
# links its group crosses.

# %%
GPT3 = functools.partial(presets.gpt3_175b, n_layer=2, vocab_size=51200)  # 51,200: Megatron's padded vocabulary
common = dict(
    mixed_precision=True,
    activation_checkpointing=True,
    warmup=False,
    progress=False,
    cluster="dgx-a100",
    seq_len=GPT3_S,
)
node = {
    "fsdp x8": simulate(GPT3, "fsdp", 8, batch_per_rank=1, forward_prefetch=True, **common),
    "tp=8": simulate(GPT3, "local", 8, batch_per_rank=8, tp=8, **common),
}
for name, sim in node.items():
    br = sim.breakdown
    print(
        f"{name:<8} step {br['step'] * 1e3:6.0f} ms: compute {br['compute'] * 1e3:5.0f}, communication exposed "
        f"{br['exposed_comm'] * 1e3:5.0f}, hidden {br['overlapped_comm'] * 1e3:5.0f} ms; sent "
        f"{sim.bytes_per_step['total'] / 1e9:5.2f} GB"
    )
assert node["tp=8"].breakdown["overlapped_comm"] < 0.05 * node["tp=8"].breakdown["exposed_comm"]  # nothing hides TP's
assert node["fsdp x8"].breakdown["overlapped_comm"] > node["fsdp x8"].breakdown["exposed_comm"]  # FSDP hides most
assert node["fsdp x8"].bytes_per_step["total"] > 2 * node["tp=8"].bytes_per_step["total"]  # for more bytes
toolkit.viz.timeline(node["fsdp x8"].modelled_run, title="modelled: FSDP over 8 GPUs, GPT-3 width, 2 layers").show()
toolkit.viz.timeline(node["tp=8"].modelled_run, title="modelled: tp=8 in one node, the same 8 sequences")

# %% [markdown]
# **The difference between FSDP and tensor parallelism**, in one sentence each:
# - *FSDP* is data parallelism with the model states sharded *between* uses: a rank computes whole layers on
#   its own sequences, gathers the parameters just in time and hides the gather behind the previous layer's
#   compute. Its bytes grow with the model (3Ψ per step), and it needs at least one sequence per GPU.
# - *Tensor parallelism* splits the *computation* of a layer: t ranks work on the same sequences, each with
#   1/t of the weights, and must meet twice per layer and pass, with nothing to hide the all-reduces behind.
#   Its bytes grow with the activations (b·s·h), so it lives inside a node, on NVLink.
#
# **Compute efficiency?** Each rank's matmuls are 1/t as large (a GPU is less efficient on smaller
# matmuls) and every all-reduce is exposed (above). **Memory efficiency?** Split weights, gradients and
# optimizer states /t; activations (10 + 24/t)·s·b·h per layer, not /t, unless sequence parallelism.
#
# ## 4. Sequence parallelism
#
# The regions between a g and the next f (layer norms, dropout, residual adds) compute the same thing on
# every tensor-parallel rank. Korthikanti et al. split them along the sequence instead: each all-reduce
# becomes a reduce-scatter (the sum, each rank keeping s/t of the positions) and an all-gather (the whole
# sequence back before the next column layer). The table in section 2 showed the result: the tp+sp row
# keeps s·b·h·34/t-style activations, every term /t. Each all-reduce's bytes are the same split in two
# halves; what sequence parallelism adds is one all-gather per column layer in backward, because the column
# layer keeps its s/t input and gathers it again instead of storing the whole one: 10 halves per layer
# instead of 8, a quarter more bytes:

# %%
for sp in (False, True):
    calls = {op: len(sizes) for op, sizes in toolkit.memory.tp_collectives(b, s, h, L, 2, sequence_parallel=sp).items()}
    print(f"sequence_parallel={sp!s:<5}: per step {calls}")
print(
    f"per layer: {tp_bytes_per_layer(1, GPT3_S, GPT3_H, 8) / 1e6:.0f} MB without, "
    f"{tp_bytes_per_layer(1, GPT3_S, GPT3_H, 8, sequence_parallel=True) / 1e6:.0f} MB with sequence parallelism "
    f"(GPT-3, tp=8, one sequence)"
)
assert tp_bytes_per_layer(1, GPT3_S, GPT3_H, 8, sequence_parallel=True) == 1.25 * tp_bytes_per_layer(
    1, GPT3_S, GPT3_H, 8
)

# %% [markdown]
# ### Hiding it anyway: `tp_comm_overlap`
#
# Sequence parallelism leaves a column layer's all-gather right before its GEMM and a row layer's reduce-scatter
# right after it, so each still stops compute. Megatron-Core hides them (`--tp-comm-overlap`): cut the sequence
# into the t ranks' chunks and the all-gather becomes t - 1 passes around a ring, each beside one chunk's GEMM (the
# chunk in hand is multiplied while the next arrives); the reduce-scatter becomes a ring of running sums, each rank
# adding its part of a chunk while the sum before travels on. `tp_comm_overlap=True` runs the same rings
# (`toolkit/parallel/tensor/overlap.py`): the same bytes, the same sums in another order. The simulator prices both
# on the DGX A100 node of section 3:

# %%
sp_node = {
    overlap: simulate(
        GPT3, "local", 8, batch_per_rank=8, tp=8, sequence_parallel=True, tp_comm_overlap=overlap, **common
    )
    for overlap in (False, True)
}
for overlap, sim in sp_node.items():
    br = sim.breakdown
    print(
        f"tp_comm_overlap={overlap!s:<5}: step {br['step'] * 1e3:4.0f} ms, GEMMs {br['gemm'] * 1e3:4.0f}, beside "
        f"NCCL's kernels {max(br['contention'], 0) * 1e3:3.0f}, communication exposed {br['exposed_comm'] * 1e3:3.0f}, "
        f"hidden {br['overlapped_comm'] * 1e3:3.0f} ms"
    )
plain, ringed = (sp_node[o].breakdown for o in (False, True))
won, paid = plain["exposed_comm"] - ringed["exposed_comm"], ringed["compute"] - plain["compute"]
print(f"won back {won * 1e3:.0f} ms of exposed communication, paid {paid * 1e3:.0f} ms more compute")
assert ringed["exposed_comm"] < 0.2 * plain["exposed_comm"]  # "most of it hides"
assert 0.5 * won < paid < won and ringed["gemm"] > 1.05 * plain["gemm"]  # "most of what it wins", "smaller GEMMs"

# %% [markdown]
# Most of the communication hides, but hiding is not free: a chunk's GEMM is t times smaller, and the GPU runs small
# GEMMs less efficiently (the last wave of tiles is partly empty), and compute beside NCCL's kernels runs slower
# (they take some of the SMs). Here the compute pays back most of what the overlap wins. It pays off where more of
# the step is traffic the rings can hide: Megatron-Core's 7.1B and 16B rows on H100 ran with it, and the simulator
# prices them so (`bench/published_runs.py`, docs/differences.md). Before TransformerEngine, Megatron-LM hid only the
# backward's: each column layer starts its collective and computes its weight's gradient meanwhile, with or without
# sequence parallelism (`tp_comm_overlap="backward"`, Megatron's default); the forward's still block.

# %% [markdown]
# ### Recomputing only the scores: selective recomputation
#
# With sequence parallelism a layer keeps s·b·h·34/t bytes plus what its attention keeps: the softmax's output,
# its dropout mask and the dropped-out scores, 5·a·s²·b/t bytes, s x s numbers per head. For GPT-3 (5·a·s/h = 80)
# that is most of the layer. Korthikanti et al. noticed they are also the cheapest activations to recompute: QKᵀ
# and a few element-wise kernels, no weight involved. `activation_checkpointing="attention"` (Megatron's
# `--recompute-granularity selective`) keeps Q, K and V and recomputes the core attention in backward
# (`toolkit/parallel/checkpointing.py`). On the same node, GPT-3's width, with the attention kernels Megatron ran
# (`as_in_papers`, "megatron": the scores stored), against keeping everything and against recomputing whole blocks:

# %%
from toolkit.memory import tp_activation_bytes  # noqa: E402
from toolkit.models.as_in_papers import as_in  # noqa: E402


def megatron_gpt3():
    return as_in(GPT3(), "megatron")  # the paper's attention: baddbmm, softmax, dropout, bmm


recomputed = {
    flag: simulate(
        megatron_gpt3,
        "local",
        8,
        batch_per_rank=1,
        tp=8,
        sequence_parallel=True,
        **dict(common, activation_checkpointing=flag),
    )
    for flag in (False, "attention", True)
}
kept = {flag: sim.moments[("forward", "forward", "(model)", 1)]["activations"] for flag, sim in recomputed.items()}
steps = {flag: sim.step_time for flag, sim in recomputed.items()}
for flag in recomputed:
    print(
        f"activation_checkpointing={flag!r:<12}: {kept[flag] / 1e6:5.0f} MB kept at the end of the forward, "
        f"step {steps[flag] * 1e3:5.1f} ms ({steps[flag] / steps[False] - 1:+.1%})"
    )
layer = {
    r: tp_activation_bytes(GPT3_S, 1, GPT3_H, 96, 8, sequence_parallel=True, recompute_attention=r) for r in (0, 1)
}
print(f"per layer (Korthikanti): {layer[0] / 1e6:.0f} MB stored, {layer[1] / 1e6:.0f} MB with the scores recomputed")
assert kept[False] - kept["attention"] == 2 * (layer[0] - layer[1])  # two layers, to the byte
assert round(1 - layer[1] / layer[0], 2) == 0.70  # "seventy percent"
assert kept[True] < kept["attention"] < kept[False]
assert steps["attention"] - steps[False] < 0.02 * steps[False] < 0.2 * (steps[True] - steps[False])  # "about 1%"

# %% [markdown]
# Seventy percent of a layer's activations for about one percent of the step; whole blocks keep less still and
# cost over ten times more. Sequence parallelism made it possible: without it the 10·s·b·h/t part of the layer
# norms and dropouts stays whole on every rank. With FlashAttention (this toolkit's GPT as it comes) there is
# nothing to gain: the fused kernel never stores the scores, and "attention" would keep only its log-sum-exp less.
# How the simulator's prices hold against the paper's own timings (its Tables 4 and 5, on A100s) is in
# docs/benchmarks.md ("Sequence parallelism and selective recomputation, predicted").

# %% [markdown]
# ## 5. At 512 to 1,024 GPUs: when does 2D FSDP + TP beat FSDP alone?
#
# torchtitan's 2D: tensor parallelism inside each 8-GPU node, FSDP over the data-parallel dimension (the
# nodes). The simulator runs both for GPT-3 175B (layers extrapolated from 2 and 3 simulated, as lesson
# 07's sweep), bf16, activation checkpointing, 2,048-token sequences, on DGX A100 nodes, at a fixed **global
# batch** (the optimizer's batch is a training decision, not something to grow with the cluster).

# %%
from toolkit.sim.sweep import sweep  # noqa: E402
from toolkit.units import bytes_text  # noqa: E402

GPT3_FULL = functools.partial(presets.gpt3_175b, vocab_size=51200)
rows = []
for batch, world in ((512, 512), (512, 1024)):
    for label, tp in (("FSDP", 1), ("FSDP + TP(8)", 8)):
        per_replica = batch * tp // world  # sequences per data-parallel replica
        if per_replica < 1:  # nothing to simulate: some GPUs would have no sequence at all
            rows.append(dict(batch=batch, world=world, label=label, per_replica=0, fits=None, step_time=None))
            continue
        options = dict(forward_prefetch=True, **({"tp": tp} if tp > 1 else {}))
        row = sweep(
            GPT3_FULL,
            layers=96,
            strategies={label: ("fsdp", options)},
            worlds=(world,),
            mixed_precision=True,
            activation_checkpointing=True,
            batch_per_rank=per_replica,
            seq_len=GPT3_S,
        )[0]
        rows.append(dict(row, batch=batch, world=world, per_replica=per_replica))
for r in rows:
    if r["fits"] is None:
        what = "cannot: fewer sequences than GPUs"
    elif not r["fits"]:
        what = f"does not fit: peak {bytes_text(r['peak'])} per GPU, {bytes_text(r['fit'].capacity)} on an A100"
    else:
        what = (
            f"{r['step_time']:6.2f} s per step, {r['tflops_per_gpu']:4.0f} TFLOP/s per GPU, exposed communication "
            f"{r['breakdown']['exposed_comm']:4.2f} s; peak {bytes_text(r['peak'])} per GPU (activations "
            f"{bytes_text(r['peak_memory']['activations'])}, comm {bytes_text(r['peak_memory']['comm'])})"
        )
    print(f"batch {r['batch']:>5}, {r['world']:>5} GPUs, {r['label']:<13} {what}")
by = {(r["batch"], r["world"], r["label"]): r for r in rows}
assert all(r["fits"] is not False for r in rows)  # every case with a sequence per GPU fits in 80 GB
assert by[(512, 512, "FSDP")]["step_time"] < by[(512, 512, "FSDP + TP(8)")]["step_time"]
assert by[(512, 1024, "FSDP")]["fits"] is None
assert by[(512, 1024, "FSDP + TP(8)")]["step_time"] < by[(512, 512, "FSDP")]["step_time"]
# what FSDP + TP(8) keeps: every layer's checkpointed input, the replica's 8 whole sequences (b s h in bf16:
# without sequence parallelism a tp rank holds the full hidden width between blocks), plus one block recomputing
two_d, fsdp_alone = by[(512, 512, "FSDP + TP(8)")], by[(512, 512, "FSDP")]
kept_inputs = 96 * 8 * GPT3_S * GPT3_H * 2
assert kept_inputs < two_d["peak_memory"]["activations"] < 1.05 * kept_inputs
assert two_d["peak_memory"]["comm"] < 1e9 and two_d["peak_memory"]["activations"] > 0.8 * two_d["peak"]
assert two_d["peak"] > fsdp_alone["peak"]
assert two_d["peak_memory"]["activations"] > 8 * fsdp_alone["peak_memory"]["activations"]

# %% [markdown]
# With at least one sequence per GPU, FSDP alone is the faster of the two in this cost model: its gathers
# hide behind compute, while TP's all-reduces, even on NVLink, are exposed and its per-rank matmuls are
# 1/8 as large (add `(1024, 1024)` to the loop: one sequence per GPU again). 2D wins where FSDP cannot go:
# **when the cluster outgrows the global batch**. A batch of 512 sequences gives FSDP at most 512 GPUs (one
# sequence each: "cannot" above means there is no sequence for some GPUs, not that memory ran out); with
# TP(8) inside the nodes, the same batch spreads over 1,024 GPUs (4 sequences per 8-GPU replica) and the
# step is faster than FSDP's best. That, and a model too large to gather one layer of, is why GPT-3-class
# models train in 2D or 3D (pipeline parallelism is the next lesson).
#
# **Memory is the price.** Every case fits in an A100's 80 GB, but FSDP + TP(8) at 512 GPUs peaks higher
# than FSDP alone, and almost all of it is activations, more than 8 times FSDP's: every GPU of a tp group
# computes on its replica's 8 sequences, and between blocks (outside the split layers) each holds the full
# hidden width. Under activation checkpointing what stays is each layer's input, 96 x 8 sequences x 2,048
# tokens x 12,288 x 2 bytes = 38.7 GB, plus one block being recomputed. Are those inputs activations or
# communication? Each is the output of the previous block's residual add, a new tensor made *after* the
# tensor-parallel all-reduce, so the simulator counts it as an activation; "comm" is only what a collective
# holds at that moment (well under a gigabyte). Sequence parallelism (section 4) splits exactly these kept
# inputs along the sequence, by 8:

# %%
sp = sweep(
    GPT3_FULL,
    layers=96,
    strategies={"FSDP + TP(8) + SP": ("fsdp", dict(forward_prefetch=True, tp=8, sequence_parallel=True))},
    worlds=(512,),
    mixed_precision=True,
    activation_checkpointing=True,
    batch_per_rank=8,
    seq_len=GPT3_S,
)[0]
print(
    f"batch   512,   512 GPUs, FSDP + TP(8) + SP: peak {bytes_text(sp['peak'])} per GPU (activations "
    f"{bytes_text(sp['peak_memory']['activations'])}), {sp['step_time']:.2f} s per step"
)
assert kept_inputs / 8 < sp["peak_memory"]["activations"] < 1.1 * kept_inputs / 8

# %% [markdown]
# **The cliff.** A tensor-parallel group should stay inside a node. To see where the step falls off, take one
# tensor-parallel group alone (no data parallelism, so nothing else crosses the network), GPT-3's width, 8
# sequences, and widen it from 4 to 32 GPUs. On DGX A100 nodes the collectives run at the bus bandwidth
# nccl-tests measure inside a node, and between nodes at eight 200 Gb/s cards' rate in NCCL (one per GPU, 24 GB/s
# each, `toolkit.sim.published`); the same nodes with a single card for their 8 GPUs are the other case:

# %%
import warnings  # noqa: E402

from toolkit.comm.emulate import Link  # noqa: E402
from toolkit.sim import cluster_of  # noqa: E402

DGX = cluster_of("dgx-a100")
ONE_CARD = DGX.with_changes(name="one card per node", inter=Link(25e9 / 8, 9.6e-6))  # 200 Gb/s shared by 8 GPUs
cliff = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for network in (DGX, ONE_CARD):
        for tp in (4, 8, 16, 32):
            cliff[(network.name, tp)] = simulate(
                GPT3, "ddp", tp, batch_per_rank=8, tp=tp, **dict(common, cluster=network)
            )
print(caught[0].message if caught else "no warning")


def tp_collectives_of(sim, tp):
    """(seconds, bytes sent) of rank 0's tensor-parallel collectives (its group: ranks 0..tp-1) in the step."""
    mine = [e for e in sim.modelled_run.events if e["cat"] == "comm" and e["args"].get("group") == list(range(tp))]
    return sum(e["end"] - e["start"] for e in mine), sum(e["args"]["bytes_sent"] for e in mine)


speed, rate, exposed = {}, {}, {}
for (network, tp), sim in cliff.items():
    seconds, sent = tp_collectives_of(sim, tp)
    speed[(network, tp)], rate[(network, tp)] = sent / seconds, sim.tflops_per_gpu
    exposed[(network, tp)] = sim.breakdown["exposed_comm"] / sim.step_time
    print(
        f"{network:<18} tp={tp:<3} {sim.tflops_per_gpu:4.0f} TFLOP/s per GPU; tp collectives at "
        f"{sent / seconds / 1e9:5.1f} GB/s, {exposed[(network, tp)]:4.0%} of the step exposed"
    )
dgx, one = DGX.name, ONE_CARD.name
assert rate[(dgx, 8)] < rate[(dgx, 4)] and rate[(dgx, 16)] < 0.85 * rate[(dgx, 8)]  # the drop doubles past the node
assert rate[(dgx, 4)] - rate[(dgx, 8)] < rate[(dgx, 8)] - rate[(dgx, 16)]
assert exposed[(dgx, 16)] > 1.5 * exposed[(dgx, 8)] and speed[(dgx, 16)] < speed[(dgx, 8)]
assert rate[(one, 16)] < rate[(one, 8)] / 2.5 and speed[(one, 16)] < speed[(one, 8)] / 5

# %% [markdown]
# Inside a node each doubling of tp halves a GPU's share of the matmuls while the bytes each all-reduce moves
# stay the same (a replica's activations), so the exposed share grows and the per-GPU rate eases down. Past the
# node it falls off: on the DGX the all-reduces now cross the network at eight cards' rate, below NVLink's,
# and the rate drops by a fifth or more at each doubling; with one card per node the collectives run an order
# of magnitude slower and the rate collapses to a third or less. Megatron keeps tp <= GPUs per node and puts
# pipeline or data parallelism across nodes. Where the toolkit's tensor parallelism differs from Megatron-LM's
# and torch's: `docs/differences.md`. Next: `labs/11-tensor-parallel`, then lesson 09, pipeline parallelism,
# the other form of model parallelism.
