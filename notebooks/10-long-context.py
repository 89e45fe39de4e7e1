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
# # 10 · Long context: context parallelism, ring attention and Ulysses
#
# Data, tensor and pipeline parallelism split the batch, the weights and the layers. At 32k-128k tokens per
# sequence none of them is enough, because what fills the GPU is neither: it is the **activations** of one
# sequence, which grow with its length. **Context parallelism** splits the sequence itself over `cp` ranks.
# Only attention mixes tokens, so only attention has to talk. The code is `toolkit/parallel/context/`, one
# idea per file (read `sequence.py`, `merge.py`, `ring.py`, `ring_attention.py`, `ulysses.py` in that order).
# The plan:
#
# 1. **why activations dominate**: Korthikanti's terms against the sequence length, next to the weights;
# 2. **the merge rule on numbers**: how two partial attentions become one (the online softmax);
# 3. **ring attention on 4 real ranks**: its timeline, the passes hidden behind attention, the zigzag that
#    balances causal work;
# 4. **ring against Ulysses**: bytes, the head limit, what can hide;
# 5. **at scale**: what a 128k context needs on 1,024 GPUs, and what Llama 3's 4D layout buys.
#
# It runs top to bottom in about a minute on a 2-core laptop. Then do `labs/13-context-parallel`: you write the
# merge and ring attention's two rings, forward and backward, graded against full attention, on their traffic and on
# the order of their events.

# %%
import math

import plotly.graph_objects as go
import torch
import torch.nn.functional as F

import toolkit
import toolkit.sim
from toolkit.memory import activation_terms, cp_activation_terms, ring_bytes_per_layer, ulysses_bytes_per_layer
from toolkit.models import tiny_gpt
from toolkit.parallel.context import SequenceSplit, merge
from toolkit.parallel.context.block import attend
from toolkit.parallel.mesh import Layout
from toolkit.run import Run
from toolkit.sim.hardware import cluster_of

GB = 1e9

# %% [markdown]
# ## 1. Why activations dominate
#
# Korthikanti et al. (2022) count what one transformer layer keeps for backward, in 16-bit values with
# dropout: **s·b·h·(34 + 5·a·s/h)** bytes for s tokens, b sequences, hidden size h and a heads. The first part
# grows with s, the second, attention's s x s scores, with s². A fused attention kernel (FlashAttention, and
# `F.scaled_dot_product_attention` everywhere in this toolkit) never stores the scores: it keeps its output and
# one log-sum-exp per row, so 34·s·b·h is what is left, still growing with every token. The weights do not grow
# at all: a layer has 12·h² parameters, 2 bytes each in bf16. Below, one GPT-3-sized layer (h = 12288, 96
# heads), one sequence.

# %%
H, HEADS = 12288, 96
lengths = [2**k for k in range(11, 18)]  # 2k .. 128k tokens
weights = 12 * H * H * 2  # bytes of one layer's bf16 weights
stored = [sum(activation_terms(s, 1, H, HEADS).values()) for s in lengths]  # scores stored
fused = [sum(activation_terms(s, 1, H, HEADS, fused_attention=True).values()) for s in lengths]
for s, a_, f_ in zip(lengths, stored, fused):
    print(
        f"s = {s:>7,}: scores stored {a_ / GB:9.1f} GB, fused attention {f_ / GB:6.1f} GB per layer"
        f"   (weights {weights / GB:.1f} GB)"
    )
assert stored[0] == 2048 * H * (34 + 5 * HEADS * 2048 / H)  # Korthikanti's closed form, to the byte
assert round(fused[0] / GB, 1) == 0.9 < round(weights / GB, 1) == 3.6 and round(fused[-1] / GB) == 55
assert fused[-1] / weights > 15  # at 128k, one sequence's activations are 15x the layer's weights
assert stored[-1] / fused[-1] > 150  # and the scores would have been 150 times that again
fig = go.Figure(
    [
        go.Scatter(x=lengths, y=[v / GB for v in stored], name="activations, scores stored", mode="lines+markers"),
        go.Scatter(x=lengths, y=[v / GB for v in fused], name="activations, fused attention", mode="lines+markers"),
        go.Scatter(x=lengths, y=[weights / GB] * len(lengths), name="the layer's bf16 weights", mode="lines"),
    ]
)
fig.update_layout(
    title="One GPT-3 layer, one sequence: what it keeps for backward",
    xaxis_type="log",
    yaxis_type="log",
    xaxis_title="tokens per sequence",
    yaxis_title="GB",
    template="plotly_white",
)
fig

# %% [markdown]
# At 2k tokens the fused layer keeps 0.9 GB, under the weights' 3.6 GB; at 128k it keeps 55 GB, fifteen times
# the weights, for *one* sequence and *one* layer. Tensor parallelism with sequence parallelism divides that by
# t, but t stops at a node (8). Nothing else splits what one sequence keeps. Context parallelism does: each of
# cp ranks holds s/cp tokens of every sequence, so it keeps what one process keeps for a sequence cp times
# shorter (`cp_activation_terms`; section 3 measures it).
#
# ## 2. The merge rule on numbers
#
# If each rank holds only some of the keys, each can compute attention over its keys alone. How do two such
# partial results become attention over all of them? For one query, block 1 has scores (0, ln 3) for values
# (1, 5), block 2 has score ln 2 for value 11. Over everything the softmax weights are (1, 3, 2)/6, so the
# answer is (1·1 + 3·5 + 2·11)/6 = 38/6. Block 1 alone gives (1 + 15)/4 = 4 with normaliser 4 (its
# log-sum-exp is ln 4); block 2 alone 11 with normaliser 2. The rule (`merge.py`):
#
#     lse = log(e^lse1 + e^lse2)                  = ln 6
#     out = e^(lse1 - lse)·out1 + e^(lse2 - lse)·out2 = (4/6)·4 + (2/6)·11 = 38/6

# %%
out1, lse1 = torch.tensor([[[[4.0]]]]), torch.tensor([[[math.log(4)]]])
out2, lse2 = torch.tensor([[[[11.0]]]]), torch.tensor([[[math.log(2)]]])
out, lse = merge(out1, lse1, out2, lse2)
print(f"merged output {out.item():.6f} (38/6 = {38 / 6:.6f}), normaliser e^lse = {lse.exp().item():.6f}")
assert abs(out.item() - 38 / 6) < 1e-6 and abs(lse.exp().item() - 6) < 1e-5

torch.manual_seed(0)  # any split of the keys, merged in any order, is attention over all of them
q, k, v = (torch.randn(1, 4, 64, 16, dtype=torch.float64) for _ in range(3))
whole = F.scaled_dot_product_attention(q, k, v)
blocks = [attend(q, k[:, :, i : i + 16], v[:, :, i : i + 16], False) for i in (48, 0, 32, 16)]
out, lse = blocks[0]
for block_out, block_lse in blocks[1:]:
    out, lse = merge(out, lse, block_out, block_lse)
print(f"four key blocks merged out of order against attention over all 64 keys: {(out - whole).abs().max():.1e}")
assert (out - whole).abs().max() < 1e-13

# %% [markdown]
# The merge is exact (to rounding), in any order, so a rank can attend to blocks of keys as they *arrive*. That
# is ring attention (Liu, Zaharia and Abbeel 2023): the cp ranks stand in a ring, each keeps its queries and
# passes its keys and values to the next rank; in cp steps every rank has seen every block, and no rank ever
# held more than two. Backward is a ring too: the keys and values go round again, and the gradient of each block
# travels with it, collecting every rank's share, until it comes home (`ring_attention.py`: a custom autograd
# Function, as Megatron-LM and torch write it).
#
# ## 3. Ring attention on 4 real ranks
#
# Causal attention adds a twist: a token sees only the tokens before it. Split the sequence into 4 contiguous
# pieces and rank 3 must attend all 4 blocks while rank 0 attends only its own: rank 0 idles three steps of
# four. Megatron-LM and torch cut the sequence into 2·cp chunks instead and give rank i chunks i and 2cp-1-i, an
# early chunk and its late mirror (`sequence.py`):

# %%
for r in range(4):
    zig, flat = SequenceSplit(4, r), SequenceSplit(4, r, zigzag=False)
    print(
        f"rank {r}: zigzag chunks {zig.chunks()}, positions {zig.positions(16).tolist()};"
        f"  contiguous {flat.positions(16).tolist()}"
    )
assert SequenceSplit(4, 0).positions(16).tolist() == [0, 1, 14, 15]

# %% [markdown]
# Below, one attention layer, forward and backward, on 4 ranks (2 sequences, 8 heads of 64, 2,048 tokens: 512
# per rank), with each split. Every pass of keys and values is a send to the next rank and a receive from the
# previous one through `toolkit.comm`, so the trace records it; each block's attention is a span of its own.


# %%
def one_layer(zigzag: bool):
    """Ring attention of one layer on this rank, forward and backward; its error against full attention."""
    import torch
    import torch.nn.functional as F

    import toolkit
    from toolkit.parallel.context import Ring, SequenceSplit, ring_attention
    from toolkit.trace.events import phase, recorder

    torch.manual_seed(0)  # every rank: the same whole sequences
    q, k, v, grad = (torch.randn(2, 8, 2048, 64) for _ in range(4))
    ring = Ring(None)
    split = SequenceSplit(ring.size, ring.rank, zigzag=zigzag)
    mine = [split.local(t, dim=2).requires_grad_() for t in (q, k, v)]
    recorder.reset()
    with phase("forward"):
        y = ring_attention(*mine, ring, split)
    with phase("backward"):
        y.backward(split.local(grad, dim=2))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return toolkit.Run.capture({"zigzag": zigzag}), (y - split.local(expected, dim=2)).abs().max().item()


def both():
    return {"zigzag": one_layer(True), "contiguous": one_layer(False)}


ranks = toolkit.launch(both, 4, timeout_s=300)
runs = {name: Run.merge(r[name][0] for r in ranks) for name in ("zigzag", "contiguous")}
errors = {name: max(r[name][1] for r in ranks) for name in runs}
print(f"largest difference from full attention on the whole sequence: {errors}")
assert max(errors.values()) < 1e-5


def attention_spans(run, rank, phase="forward"):
    return [e for e in run.events if e["rank"] == rank and e["name"] == "ring attention" and e["phase"] == phase]


for name, run in runs.items():
    blocks = [len(attention_spans(run, r)) for r in range(4)]
    seconds = [sum(e["end"] - e["start"] for e in attention_spans(run, r)) for r in range(4)]
    print(
        f"{name:>10}: blocks attended per rank {blocks}, attention time per rank (ms) "
        f"{[round(t * 1e3) for t in seconds]}"
    )
assert [len(attention_spans(runs["zigzag"], r)) for r in range(4)] == [4, 4, 4, 4]
assert [len(attention_spans(runs["contiguous"], r)) for r in range(4)] == [1, 2, 3, 4]
toolkit.viz.timeline(runs["zigzag"], phase="forward", title="ring attention, zigzag: one layer's forward, 4 ranks")

# %% [markdown]
# With the contiguous split rank r attends r + 1 blocks (rank 0 one, rank 3 four); with zigzag every rank attends
# 4, each after the first half a block: the same work on every rank (`ring_attention.part` says which half).
# The timeline shows the overlap: each send (and the receive beside it) starts *before* the attention of the
# block the rank already holds, and that attention runs while the next block travels. Below, counted from the
# trace: every pass but the last was issued before the block attention it overlaps ended.


# %%
def overlapped(run, rank):
    sends = sorted(
        (e for e in run.events if e["rank"] == rank and e["name"] == "send" and e["phase"] == "forward"),
        key=lambda e: e["start"],
    )
    spans = sorted(attention_spans(run, rank), key=lambda e: e["start"])
    return [send["start"] < span["end"] for send, span in zip(sends, spans)]


for rank in range(4):
    print(f"rank {rank}: each pass issued before the attention beside it ended: {overlapped(runs['zigzag'], rank)}")
assert all(all(overlapped(runs["zigzag"], r)) and len(overlapped(runs["zigzag"], r)) == 3 for r in range(4))

# %% [markdown]
# ## 4. Ring against Ulysses
#
# DeepSpeed-Ulysses (Jacobs et al. 2023) takes the other way round: attention is independent per *head*, so one
# all-to-all before attention turns "all heads of my s/cp tokens" into "a/cp heads of all s tokens", ordinary
# attention runs on whole sequences, and one all-to-all after turns the output back (`ulysses.py`). Per layer
# and rank (`toolkit.memory.context_formulas`, both held to the simulated programs by the tests):
#
# | | forward bytes per rank | where | limit |
# |---|---|---|---|
# | ring | (cp-1)/cp of K and V, 2·b·s·h values | neighbours only, hidden behind attention when it is long enough | none |
# | Ulysses | (cp-1)/cp of q, k, v and the output, 4·b·(s/cp)·h | all-to-all, on the critical path | heads % cp == 0 |
#
# The per-layer bytes at GPT-3's width (bf16, one sequence of 128k tokens):

# %%
S = 131072
print(f"{'cp':>4}{'ring GB/layer':>16}{'Ulysses GB/layer':>18}")
for cp in (2, 4, 8, 16, 32):
    ring, uly = ring_bytes_per_layer(1, S, H, cp), ulysses_bytes_per_layer(1, S, H, cp)
    print(f"{cp:>4}{ring['forward'] / GB:16.2f}{uly['forward'] / GB:18.2f}")
assert ring_bytes_per_layer(1, S, H, 2)["forward"] == ulysses_bytes_per_layer(1, S, H, 2)["forward"]
assert ulysses_bytes_per_layer(1, S, H, 16)["forward"] * 8 == ring_bytes_per_layer(1, S, H, 16)["forward"]
try:
    toolkit.parallel.context.model.check(tiny_gpt(n_head=12, d_model=48), "ulysses", 8)
    raise AssertionError("12 heads over cp = 8 should have been refused")
except ValueError as exc:
    print(f"\nthe head limit, said before anything runs: {exc}")

# %% [markdown]
# At cp = 2 the two send the same; at cp = 16 Ulysses sends 1/8 of the ring's bytes, and it needs no load
# balancing (every rank attends whole sequences). But its all-to-alls sit on the critical path and cross every
# link of the group at once, and cp cannot exceed the heads (a model with 12 heads cannot use cp = 8). The ring's
# bytes are larger but only between neighbours, and they **hide behind attention when a block's attention takes
# longer than its transfer**. A block of s/cp tokens takes about 2·b·(s/cp)²·h FLOPs of zigzag attention (half a
# block) and moves 2·b·(s/cp)·h·2 bytes (bf16 K and V), so the ratio grows with s/cp. On DGX H100 (the simulator's
# preset: 989 TFLOP/s at the fastest GEMM's 80%, NVLink 450 GB/s a direction inside a node, 50 GB/s per GPU
# across), the tokens per rank above which a pass hides:

# %%
h100 = cluster_of("dgx-h100")
rate = h100.gpu.peak_flops["bf16"] * h100.gpu.matmul_efficiency
hides = {
    name: 2 * rate / link.bandwidth for name, link in (("inside a node", h100.intra), ("across nodes", h100.inter))
}
for name, tokens in hides.items():
    print(f"{name:>14}: a pass hides once each rank holds more than {tokens:,.0f} tokens")
assert 3000 < hides["inside a node"] < 4000 and 30000 < hides["across nodes"] < 35000
assert S / 16 < hides["across nodes"]  # 128k over cp = 16: 8,192 tokens per rank, too few to hide across nodes

# %% [markdown]
# Inside a node a ring hides from about 3,500 tokens per rank; across nodes it needs about 32,000. With tp = 8
# filling a node, a cp group spans nodes, and 128k tokens over cp = 16 leaves 8,192 per rank: the passes cannot
# hide. This is why Llama 3 (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.2) did not use a ring
# for its 128k stage: its cp ranks all-gather K and V once per layer, which grouped-query attention makes 16x
# smaller than the queries (8 key-value heads for 128 query heads); this toolkit's GPT has as many key-value
# heads as heads, so its K and V are the full width.
#
# ## 5. At scale: 128k tokens on 1,024 GPUs, and Llama 3's layout
#
# A GPT the width of Llama 3 70B (h = 8192, 64 heads, 80 layers; this GPT's MLP made as large as Llama's
# three-matrix one, its K and V full width, and its learned position table of 128k x 8192 = 1.1B parameters,
# which Llama's rotary positions do not have), one 128k-token sequence per model replica, bf16, on 1,024 H100.
# FSDP shards over dp x cp, tp = 8 with sequence parallelism inside each node, and cp takes what is left of a
# replica. The simulator runs the toolkit's own code for one rank with 1 and 2 layers; everything a rank holds
# at the end of forward (activations and model states) grows by the same amount with each layer, so 80 layers
# follow from the two, the per-layer activations next to `cp_activation_terms`.

# %%
LLAMA70 = dict(vocab_size=128256, seq_len=S, n_head=64, d_model=8192, d_ff=28672 * 3 // 2)
LAYERS = 80


def at_end_of_forward(**options):
    """(bytes a rank holds at the end of forward with 80 layers, of them the model states, activations per
    layer) on 1,024 H100."""
    held = []
    for n in (1, 2):
        sim = toolkit.sim.simulate(
            lambda n=n: tiny_gpt(n_layer=n, **LLAMA70),
            "fsdp",
            1024,
            seq_len=S,
            mixed_precision=True,
            sequence_parallel=True,
            progress=False,
            **options,
        )
        held.append((next(x["activations"] for x in sim.samples if x["phase"] == "forward"), sim.memory["total"]))
    (acts1, states1), (acts2, states2) = held
    states = states1 + (LAYERS - 1) * (states2 - states1)
    return acts1 + (LAYERS - 1) * (acts2 - acts1) + states, states, acts2 - acts1


layouts = {"tp 8, cp 1, dp 128": dict(tp=8), "tp 8, cp 16, dp 8": dict(tp=8, cp=16)}
found = {label: at_end_of_forward(**options) for label, options in layouts.items()}
for label, (total, _states, per_layer) in found.items():
    formula = sum(
        cp_activation_terms(
            S,
            1,
            8192,
            64,
            layouts[label].get("cp", 1),
            tp=8,
            sequence_parallel=True,
            fused_attention=True,
            dropout=False,
            small_terms=True,
            ffn_hidden=LLAMA70["d_ff"],
        ).values()
    )
    print(
        f"{label:>20}: activations per layer {per_layer / GB:5.2f} GB (formula {formula / GB:5.2f}); "
        f"80 layers and the model states at the end of forward: {total / GB:6.1f} GB of 80"
    )
    assert abs(per_layer - formula) < 1e-4 * formula  # the allocator's 512-byte blocks
without, llama_like = found["tp 8, cp 1, dp 128"], found["tp 8, cp 16, dp 8"]
assert round(without[0] / (80 * GB)) == 5 and 1.3 * GB < without[1] < 1.5 * GB and llama_like[0] < 40 * GB
assert 15.9 < without[2] / llama_like[2] <= 16

# %% [markdown]
# Without cp, what one rank must hold at the end of forward is five times an H100's 80 GB, whatever the data
# parallelism (the model states are 1.4 GB of it: FSDP has sharded them over dp); with cp = 16 each layer keeps
# 1/16 as much, and the whole is under half the GPU (backward adds FSDP's gathered units and the gradients, a
# few GB here). Llama 3's 405B model trained its 128k stage on 16,384 H100 with **tp 8, cp 16, pp 16, dp 8**
# (Dubey et al. 2024, Table 4: 16M tokens per batch, 380 TFLOP/s per GPU, 38% of bf16 peak), ordered
# [tp, cp, pp, dp] from the innermost: `order="tp-cp-pp-dp"` here (`toolkit.parallel.mesh`).
# What that order decides, read from the layout:

# %%
llama3 = Layout(dp=8, pp=16, cp=16, tp=8, order="tp-cp-pp-dp")
node = lambda rank: rank // 8  # noqa: E731 - 8 GPUs per node
for dim in ("tp", "cp", "pp", "dp"):
    group = llama3.group_of(0, dim)
    print(f"rank 0's {dim} group: {len(group):>3} ranks {group[:4]}..., on {len({node(r) for r in group})} node(s)")
assert llama3.world_size == 16384 and {node(r) for r in llama3.group_of(0, "tp")} == {0}
assert len({node(r) for r in llama3.group_of(0, "cp")}) == 16  # every cp pass crosses the network
print(
    f"tokens per rank at 128k over cp = 16: {S // 16:,}; per batch: dp 8 x 16 sequences x 128k = "
    f"{8 * 16 * S / 1e6:.1f}M"
)
assert S // 16 == 8192 and round(8 * 16 * S / 1e6) == 17  # "16M" in the paper: 16 x 2^20

# %% [markdown]
# Tensor parallelism, the chattiest, stays inside a node; each cp group spans 16 nodes, so cp's traffic crosses
# the network, which is why Llama 3 made it as small as possible (an all-gather of grouped-query K and V) and why
# pp and dp, which talk least, are outermost. What the fourth dimension bought: the 128k stage ran on the same
# 16,384 GPUs and the same 16M tokens per batch as the 8k stage before it (Table 4: tp 8, cp 1, pp 16, dp 128),
# each rank holding 8,192 tokens of a sequence, as in the 8k stage, and the rate fell only from 400 to 380
# TFLOP/s per GPU.
#
# What do the layouts that fit cost? Priced on the DGX H100 preset (`toolkit.sim.sweep`: three and four layers
# simulated and extrapolated to 80; each kernel and collective at its published rate, `toolkit.sim.published`),
# three of them for the GPT above on 1,024 H100: the ring at cp = 8 (16,384 tokens per rank, dp 16), Ulysses at
# cp = 8 (its limit here: 64 heads over tp = 8 leave 8 a rank) and the ring at cp = 16 (8,192 tokens per rank, dp
# 8). Each replica trains on one sequence a step, so the rate that compares them is tokens per second per GPU.

# %%
from toolkit.sim.sweep import sweep

choices = {"ring, cp 8": dict(cp=8), "Ulysses, cp 8": dict(cp=8, cp_attention="ulysses"), "ring, cp 16": dict(cp=16)}
priced = {
    row["label"]: row
    for row in sweep(
        lambda n_layer: tiny_gpt(n_layer=n_layer, **LLAMA70),
        layers=LAYERS,
        strategies={label: ("fsdp", dict(tp=8, sequence_parallel=True, **o)) for label, o in choices.items()},
        worlds=(1024,),
        cluster="dgx-h100",
        mixed_precision=True,
        seq_len=S,
    )
}
rate = {label: 1024 // (8 * choices[label]["cp"]) * S / row["step_time"] / 1024 for label, row in priced.items()}
for label, row in priced.items():
    b = row["breakdown"]
    print(
        f"{label:>14}: peak {row['peak'] / GB:3.0f} GB, step {row['step_time']:4.1f} s, attention "
        f"{b['attention']:.1f} s, exposed communication {b['exposed_comm']:.1f} s: {rate[label]:.0f} tokens/s per GPU"
    )
ring8, uly8, ring16 = (priced[label] for label in choices)
assert all(row["fits"] for row in priced.values()) and round(ring16["peak"] / GB) < round(ring8["peak"] / GB) < 80
assert 0.15 < ring8["breakdown"]["exposed_comm"] / ring8["step_time"] < 0.25  # "about a fifth"
assert 1.0 < ring8["step_time"] / uly8["step_time"] < 1.15  # "a little shorter"
assert 1 / 3 < ring16["breakdown"]["exposed_comm"] / ring16["step_time"] < 0.45  # "over a third"
assert 0.6 < rate["ring, cp 16"] / rate["ring, cp 8"] < 0.7  # "about two thirds"
assert 0.4 < S / 8 / hides["across nodes"] < 0.6  # 16,384 tokens a rank: about half what hides across nodes
assert ring_bytes_per_layer(1, S, 8192, 8)["forward"] == 4 * ulysses_bytes_per_layer(1, S, 8192, 8)["forward"]

# %% [markdown]
# All three fit. The ring at cp = 8 leaves about a fifth of its step to passes it cannot hide: 16,384 tokens per
# rank is half what a pass across nodes needs to hide (section 4). Ulysses sends a quarter of the ring's bytes at
# cp = 8 (section 4's table: cp/2 times fewer), on the critical path, and its step is a little shorter (under 15%).
# At cp = 16 each rank holds 8,192 tokens: over a third of the ring's step is exposed communication and the rate per
# GPU falls to about two thirds of cp = 8's, for the memory it saves. Llama 3 went to cp = 16 with K and V a sixteenth as wide
# (grouped-query attention) and gathered once per layer. `.venv/bin/python bench/long_context.py` prices every
# dp x pp x cp layout of this model on 1,024 H100, and Llama 3 405B's own layout at 16,384, against the paper's
# rate (docs/benchmarks.md).
#
# **Try it**: `toolkit.parallel.wrap(model, "fsdp", cp=2, cp_attention="ulysses")` trains any toolkit GPT with
# Ulysses; `.venv/bin/python -m toolkit simulate --model zero-7.5b --strategy fsdp --world-size 64 --cp 8` prices
# ZeRO's 7.5B model at its 8,192-token context with cp = 8 on DGX A100 (fsdp over dp 8 x cp 8).
