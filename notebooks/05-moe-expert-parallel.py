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
# # 05 · Mixture of Experts and expert parallelism
#
# A transformer block spends most of its parameters in the MLP. A **Mixture-of-Experts (MoE)** layer
# replaces that one MLP by E of them (the **experts**) and a tiny **router** that sends each token to
# only k of them. Parameters grow with E; the work done for one token does not. The price is paid in
# other currencies: tokens must travel to wherever their experts live, experts receive uneven loads,
# and a full expert must turn tokens away.
#
# This notebook runs every step for real, on 2 ranks (gloo on the CPU; NCCL on GPUs):
#
# 1. **why MoE**: parameters and compute per token of this notebook's model as E grows;
# 2. **the gate**: top-k routing of a small batch, by hand;
# 3. **capacity and dropping**: C = ceil(k·f·T/E), and which tokens lose their seat; how tokens reach
#    their slots: GShard's one-hot einsum against Tutel's fast encode/decode, in memory and time;
# 4. **expert parallelism**: experts split over the ranks, the count exchange and the two all-to-alls
#    (dispatch, combine) on the timeline of a real run, forward and backward;
# 5. **the expert load over training**: skewed and drifting, as FasterMoE observed, on a real training run;
# 6. **data parallelism versus expert parallelism** for the expert weights: what each sends (Tutel's
#    complexity comparison), computed for this model and measured from the traces.
#
# It runs top to bottom in about a minute on a 2-core laptop. Then do `labs/04-moe-dispatch`: you write
# the dispatch and combine yourself and the grader checks them on real ranks. Where the toolkit's layer
# differs from FastMoE, Tutel and DeepSpeed-MoE, and what you would notice: `docs/differences.md`.

# %%

import torch

import toolkit
from toolkit import viz
from toolkit.memory import communication_per_step
from toolkit.models import moe_gpt, tiny_gpt
from toolkit.moe import TopKGate, capacity, is_expert, merge_load
from toolkit.run import Run

WORLD = 2  # ranks
E, K, FACTOR = 8, 2, 1.25  # experts per MoE layer, experts per token, capacity factor
SHAPE = dict(n_layer=2, d_model=32, n_head=2)  # the tiny GPT of the other notebooks; d_ff = 4 * d_model
D, FF = SHAPE["d_model"], 4 * SHAPE["d_model"]

# %% [markdown]
# ## 1. Why MoE: parameters grow, compute per token does not
#
# One expert is the block's usual MLP: `d_model -> d_ff -> GELU -> d_model`, 2·d·d_ff weights (plus
# biases), and about 2·(2·d·d_ff) floating-point operations per token in the forward pass (a multiply
# and an add per weight). An MoE layer with E experts holds E times those weights, but a token visits
# only k experts, plus the router (d·E weights, one score per expert). With k = 1 (Switch) a token costs
# what it cost in the dense model; with k = 2 (GShard) twice that, *whatever E is*.


# %%
def mlp_numbers(experts, k):
    """(weights, forward FLOPs per token) of one MoE MLP with `experts` experts, top-k (experts=1: dense)."""
    one = 2 * D * FF + FF + D
    if experts == 1:
        return one, 2 * 2 * D * FF
    return experts * one + D * experts, k * 2 * 2 * D * FF + 2 * D * experts


dense_model = tiny_gpt(**SHAPE)
print(f"tiny GPT {SHAPE}: {dense_model.num_params():,} parameters\n")
print(f"{'MLP':<18}{'weights per layer':>18}{'FLOPs per token':>17}{'whole model':>13}")
for experts in (1, 2, 4, 8, 16, 64):
    weights, flops = mlp_numbers(experts, K)
    torch.manual_seed(0)
    total = dense_model.num_params() if experts == 1 else moe_gpt(experts, K, **SHAPE).num_params()
    label = "dense" if experts == 1 else f"{experts} experts, top-{K}"
    print(f"{label:<18}{weights:>18,}{flops:>17,}{total:>13,}")

# %% [markdown]
# From 2 to 64 experts the MLP's weights grow 32-fold while a token's work stays at two expert visits
# (the router's 2·d·E FLOPs are a rounding error). The same arithmetic at scale: FasterMoE's models
# have L·(2αE + 4)·H² parameters (H = d_model, αH = the FFN width, α = 2), so their "MoE-GPT-S" with
# 12 layers, H = 1024 and 16 experts has

# %%
L_, H_, E_, alpha = 12, 1024, 16, 2
print(
    f"L·(2αE+4)·H² = {L_ * (2 * alpha * E_ + 4) * H_**2 / 1e9:.2f} B parameters, "
    f"where a dense model of the same shape has {L_ * (2 * alpha + 4) * H_**2 / 1e9:.2f} B"
)

# %% [markdown]
# ## 2. The gate
#
# The router is a linear map from a token to E scores; a softmax turns them into probabilities; the
# gate keeps the k largest. Their probabilities, renormalised to sum to 1 (for k > 1), are the weights
# with which the k experts' answers are added up. `toolkit.moe.TopKGate` does exactly this. Here: 12
# tokens, 4 experts, top-2, with a router that likes expert 0 (as routers often end up doing).

# %%
torch.manual_seed(1)
T_small, E_small, d_small = 12, 4, 8
gate = TopKGate(d_small, E_small, top_k=2, capacity_factor=1.0)
with torch.no_grad():
    gate.router.weight.normal_(0, 1.0)
    gate.router.weight[0, 0] = 3.0  # expert 0 scores high for tokens with a large feature 0
tokens = torch.randn(T_small, d_small)
tokens[:, 0] = tokens[:, 0].abs()
routing = gate(tokens)
probs = torch.softmax(tokens @ gate.router.weight.t(), dim=-1)

print("token  probabilities (experts 0..3)     choices   weights       slots")
for t in range(T_small):
    p = " ".join(f"{v:.2f}" for v in probs[t].tolist())
    w = " ".join(f"{v:.2f}" for v in routing.gate_weight[t].tolist())
    print(f"{t:>5}  {p:<32} {routing.expert_index[t].tolist()!s:<9} {w:<13} {routing.slot[t].tolist()}")
print(f"\nchoices per expert (before capacity): {routing.counts.tolist()}   (T·k = {T_small * 2})")

# %% [markdown]
# Each choice also got a **slot**: its position in its expert's buffer. Slots are handed out to every
# token's *first* choice before any *second* choice (GShard's rule), so that when a buffer overflows,
# tokens lose their second expert before anyone loses their first.
#
# ## 3. Capacity and dropping
#
# Communication libraries want fixed shapes, and a GPU kernel wants a fixed batch; so every expert gets
# a buffer of **C slots** per rank,
#
# $$ C = \left\lceil \frac{k \cdot f \cdot T}{E} \right\rceil ,$$
#
# for T tokens on the rank and a **capacity factor** f. With perfectly balanced routing an expert
# receives k·T/E choices; f > 1 is slack for imbalance. A choice whose slot is ≥ C is **dropped**: that
# expert does not see the token, and the token's output only has its other expert's share (with
# both dropped, the residual connection carries the token past the layer unchanged). Same batch,
# several factors:

# %%
print(f"{'f':>5} {'C':>3}  kept per expert   dropped   tokens that lost a 1st / 2nd choice")
for f in (0.5, 1.0, 1.25, 2.0):
    C = capacity(T_small, E_small, 2, f)
    r = routing.with_capacity(C)
    lost = (~r.kept).sum(0).tolist()
    print(f"{f:>5} {C:>3}  {r.kept_counts.tolist()!s:<17} {r.dropped:>7}   {lost[0]} / {lost[1]}")

# %% [markdown]
# Expert 0, the popular one, overflows first. Raising f keeps more tokens, but every slot is memory and,
# once experts live on other ranks, traffic: padding buffers to C costs even when they are half
# empty. Balance is therefore worth a lot, which is why MoE training adds a **load-balancing loss**
# (GShard's: E²·mean_e(f_e·m_e), 1.0 when balanced, with f_e the share of first choices going to e and
# m_e its mean probability):

# %%
print(
    f"this batch: GShard auxiliary loss {routing.aux_loss.item():.3f} (1.0 = balanced, {E_small} = all on one expert)"
)

# %% [markdown]
# ### Getting tokens into their slots: one-hot einsum, or Tutel's fast encode and decode
#
# GShard writes the move into the experts' (E, C, d) buffers, and back, as two einsums with dense
# (T, E, C) masks: a one-hot *dispatch mask* (token t sits in slot c of expert e) and the *combine
# weights* (the same, holding the gate weight):
#
# $$ \text{buffers}_{ecd} = \sum_t \text{mask}_{tec}\, x_{td}, \qquad y_{td} = \sum_{e,c} \text{weights}_{tec}\, \text{out}_{ecd}. $$
#
# Each mask has T·E·C entries, and with C = k·f·T/E that is k·f·T²: quadratic in the tokens, nearly all
# zeros, and each einsum multiplies all of them by d numbers. Tutel's **fast encode and decode** (fused
# GPU kernels there; "90 % less memory" in its slides) instead write each kept (token, choice) to its
# slot by index and read it back the same way: work and memory O(T·k·d), no mask. `toolkit.moe.encode`
# has both forms in plain torch. The same tokens through both, encode then decode (experts left out),
# memory measured with torch's `MemTracker` (peak bytes allocated), time the fastest of a few runs
# (the least disturbed by whatever else shares this machine):

# %%
import time

from torch.distributed._tools.mem_tracker import MemTracker

from toolkit.moe.encode import decode_einsum, decode_index, encode_einsum, encode_index


def cost(fn, *args):
    """(result, peak bytes allocated, fastest seconds) of fn(*args): at least 3 runs, up to 50 or 0.1 s."""
    tracker = MemTracker()
    with tracker:
        result = fn(*args)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    seconds = []
    while len(seconds) < 3 or (sum(seconds) < 0.1 and len(seconds) < 50):
        start = time.perf_counter()
        fn(*args)
        seconds.append(time.perf_counter() - start)
    return result, peak, min(seconds)


torch.manual_seed(0)
print(f"{'T':>5}{'C':>5}{'einsum: memory':>16}{'time':>10}{'index: memory':>15}{'time':>10}   einsum / index")
for T_enc in (128, 256, 512):
    gate_enc = TopKGate(D, E, top_k=K, capacity_factor=FACTOR)
    x_enc = torch.randn(T_enc, D)
    with torch.no_grad():
        r_enc = gate_enc(x_enc)
        slow, slow_peak, slow_s = cost(lambda r, x: decode_einsum(r, encode_einsum(r, x)), r_enc, x_enc)
        fast, fast_peak, fast_s = cost(lambda r, x: decode_index(r, encode_index(r, x)), r_enc, x_enc)
    assert torch.allclose(slow, fast, atol=1e-5)  # the same numbers either way
    print(
        f"{T_enc:>5}{r_enc.capacity:>5}{slow_peak / 1e6:>13.2f} MB{slow_s * 1e3:>8.1f}ms{fast_peak / 1e6:>12.3f} MB"
        f"{fast_s * 1e3:>8.2f}ms   {slow_peak / fast_peak:>4.0f}x memory, {slow_s / fast_s:>4.0f}x time"
    )

# %% [markdown]
# Doubling the tokens doubles the index form's memory and roughly quadruples the einsum's: the masks
# grow with T·C. (Times on a shared CPU move between runs; the ratios' growth is the point.) The layer
# of section 4 goes one step further than Tutel's buffers: only kept rows travel, sorted by destination,
# so there is no (E, C, d) buffer at all.

# %% [markdown]
# ## 4. Expert parallelism: experts on different ranks, tokens travel
#
# With W ranks, rank r holds experts r·E/W .. (r+1)·E/W - 1; every rank routes *its own* tokens. One
# forward of `toolkit.moe.MoE` (lab 04 has you write these steps: do it before you read
# `toolkit/moe/layer.py`, which holds its answers):
#
# 1. **route**: the gate above, on this rank's tokens;
# 2. **exchange counts**: an all-to-all of E integers: rank r learns how many rows each rank will send
#    to each of its experts, so the next all-to-all can have uneven splits;
# 3. **sort by destination**: kept (token, choice) pairs ordered by expert, hence by owning rank;
# 4. **dispatch**: all-to-all of the rows;
# 5. **experts**: each local expert runs on the rows it received;
# 6. **combine**: all-to-all back, splits swapped: every answer returns to the rank its token lives on;
# 7. **weighted sum** with the gate weights.
#
# Backward runs the two big all-to-alls again, in reverse: the gradient of an all-to-all is the
# all-to-all with the splits swapped. Below, 2 ranks each push a different number of tokens through
# one layer (E = 8 experts, 4 per rank) and back. The door labels each all-to-all (`args["moe"]`), which
# the timeline shows. The same launch also all-reduces a tensor as large as *all* the layer's expert
# gradients, which is what data parallelism would have to send if every rank kept every expert (section 6).


# %%
def one_layer(tokens_per_rank):
    import torch
    import torch.distributed as dist

    from toolkit import comm
    from toolkit.moe import MoE
    from toolkit.run import Run
    from toolkit.trace import phase, recorder, span

    rank = dist.get_rank()
    layer = MoE(32, 128, 8, top_k=2, capacity_factor=1.25, seed=0, name="demo")
    x = torch.randn(tokens_per_rank[rank], 32, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    recorder.reset()
    for _ in range(2):  # the second pass is the one to look at (the first warms up)
        with phase("moe forward"), span("forward"):
            out, aux = layer(x)
        with phase("moe backward"), span("backward"):
            (out.square().mean() + 0.01 * aux).backward()
    expert_grads = torch.cat([p.grad.reshape(-1) for p in layer.experts.parameters()])
    everything = torch.zeros(expert_grads.numel() * dist.get_world_size())  # all E experts' gradients
    with phase("dp of experts"):
        for _ in range(2):
            comm.all_reduce(everything)
    load = recorder.metrics[-1]["value"]
    return Run.capture({"tokens": tokens_per_rank}), load


results = toolkit.launch(one_layer, WORLD, args=([96, 64],))
layer_run = Run.merge(r for r, _ in results)
for rank, (_, load) in enumerate(results):
    print(
        f"rank {rank}: {sum(load['counts'])} choices routed, per expert {load['counts']}, capacity {load['capacity']}, "
        f"dropped {load['dropped']}; its experts {load['first']}..{load['first'] + 3} received {load['received']}"
    )

# %% [markdown]
# The rows each all-to-all moved, as rank 0 recorded them (`input_splits[j]` rows went to rank j; the
# rows for rank 0 itself never leave it), in the second pass:

# %%
calls = [e for e in layer_run.comm_events(0, "all_to_all")]
second = calls[len(calls) // 2 :]
print(f"{'all-to-all':<20}{'rows sent to rank 0, 1':>24}{'rows received':>16}{'bytes sent':>12}")
for e in second:
    a = e["args"]
    print(f"{a['moe']:<20}{a['input_splits']!s:>24}{a['output_splits']!s:>16}{a['bytes_sent']:>12,}")

# %% [markdown]
# Read the rows: *counts* moves E integers; *dispatch* sends the rows chosen for the other rank's
# experts; *combine* sends back the answers, the same numbers with sent and received swapped; the
# backward pair repeats them in reverse. On the timeline (second pass, both ranks), each labelled
# all-to-all has its own colour; the experts' compute sits between dispatch and combine:


# %%
def labelled(run):
    """A copy of the Run whose all-to-alls are named after their role (counts, dispatch, combine, ...)."""
    events = [dict(e, name=f"all_to_all · {e['args']['moe']}") if e["args"].get("moe") else e for e in run.events]
    return Run(run.config, events, run.samples, run.metrics, run.meta)


start = min(
    sorted(e["start"] for e in layer_run.events if e["name"] == "forward" and e["rank"] == r)[1]
    for r in layer_run.ranks
)  # the second pass
viz.timeline(
    labelled(layer_run),
    where=lambda e: e["start"] >= start - 1e-4 and e["phase"].startswith("moe"),
    title="One MoE layer, forward then backward, on 2 ranks: count exchange, dispatch, experts, combine",
)

# %% [markdown]
# Things to see: the count exchange is tiny but still a full collective round (latency); dispatch and
# combine carry the bulk; a rank that routed more tokens, or whose experts are popular, makes the
# other wait inside the next all-to-all, since nobody can leave a collective before everybody has
# arrived. That waiting is load imbalance made visible.
#
# ## 5. The expert load over training
#
# FasterMoE's first observation: in real training the router's choices are **skewed** (a few
# experts are popular) and they **drift** (which experts are popular changes from iteration to
# iteration and over training), so the busiest expert, and the rank holding it, sets the pace. The MoE
# layers record their load at every forward (`moe/<layer>/load` in the Run); `viz.expert_load` draws it.
#
# Two real trainings of the MoE-GPT (8 experts per layer, 4 per rank, top-2, capacity factor 1.25, the
# router starting with confident scores), expert parallel on 2 ranks with DDP for the dense parameters:
# one **without** the load-balancing loss, one with it weighted 0.1.


# %%
def two_trainings(steps):
    from toolkit.train import TrainConfig, moe_model_fn, train

    runs = {}
    for label, weight in (("no balancing loss", 0.0), ("balancing loss 0.1", 0.1)):
        config = TrainConfig(
            strategy="ddp",
            steps=steps,
            global_batch_size=8,
            model=dict(SHAPE, aux_loss_weight=weight),
            progress=False,
            sample_memory=False,
        )
        runs[label] = train(config, model_fn=moe_model_fn(E, K, capacity_factor=FACTOR, moe_options=dict(init_std=0.1)))
    return runs


per_rank = toolkit.launch(two_trainings, WORLD, args=(40,))
trainings = {label: Run.merge(r[label] for r in per_rank) for label in per_rank[0]}
for label, run in trainings.items():
    rows = merge_load(run.metrics, "layer0")
    dropped = sum(r["dropped"] for r in rows) / sum(sum(r["counts"]) for r in rows)
    print(
        f"{label:<20} final loss {run.metric('loss')[-1][1]:.3f} · layer0: mean max/mean "
        f"{sum(r['max_over_mean'] for r in rows) / len(rows):.2f}, {dropped:.1%} of choices dropped"
    )

# %%
viz.expert_load(trainings["no balancing loss"])

# %% [markdown]
# Read the heatmap column by column (one column per forward pass; red = busier than a balanced expert,
# blue = idler, a black dot on the busiest): without a balancing loss a couple of experts take a large
# share, the dots jump between rows as training moves the router, the drops (middle) follow the
# imbalance (bottom), and the dropdown shows the second layer behaving differently from the first.
# With the balancing loss the colours are paler, but the load is still uneven and still drifting:

# %%
viz.expert_load(trainings["balancing loss 0.1"])

# %% [markdown]
# A static placement of experts cannot follow this: whatever rank holds today's popular expert is
# the straggler, and tomorrow another one is. That is the motivation for FasterMoE's *shadowing*
# (replicate the popular experts for a step, decided from the counts the layer has just exchanged)
# and for dynamic capacity, topics of the next notebook.
#
# ## 6. Data parallelism versus expert parallelism for the expert weights
#
# There are two ways to train E experts on W ranks (Tutel's comparison, P = the expert parameters):
#
# | | what every rank holds | what it sends per step | Tutel's complexity |
# | --- | --- | --- | --- |
# | **DP**: experts replicated | all E experts | an all-reduce of all expert gradients, 2·(W-1)/W·P | O(P) |
# | **EP**: experts split | E/W experts | its tokens' rows: 4 all-to-alls per layer (dispatch, combine, twice) | O(C_g) |
#
# where C_g is the number of token rows a rank's all-to-all carries, bounded by capacity:
# C_g ≤ E·C = k·f·T for T tokens on the rank. (With more ranks than experts, W > E, each expert lives on
# W/E ranks: gathered whole there, EP+DP costs O(C_g + P/E); sliced, EP+DP+MP costs O(C_g·W/E);
# notebook 06 runs both.) DP's cost grows with the *model*, EP's with the *batch*. For this notebook's model:

# %%
torch.manual_seed(0)
model = moe_gpt(E, K, **SHAPE)
P = sum(p.numel() for p in model.parameters() if is_expert(p))
layers = SHAPE["n_layer"]
T = 8 // WORLD * 32  # tokens per rank per step: 4 rows of 32 tokens
C_g = E * capacity(T, E, K, FACTOR)  # rows one rank's dispatch buffer can carry
dp_bytes = communication_per_step(P, WORLD, "ddp") * 4
ep_balanced = layers * 4 * (WORLD - 1) / WORLD * T * K * D * 4
ep_capacity = layers * 4 * (WORLD - 1) / WORLD * C_g * D * 4
print(f"expert parameters P = {P:,} ({layers} layers x {E} experts); T = {T} tokens per rank per step, k = {K}")
print(f"DP of the experts: all-reduce 2(W-1)/W·P·4 B          = {dp_bytes / 1e3:8.1f} KB per rank per step")
print(f"EP, balanced routing: 4 all-to-alls x (W-1)/W·T·k rows = {ep_balanced / 1e3:8.1f} KB")
print(f"EP, capacity bound: rows <= E·C = {C_g}                  = {ep_capacity / 1e3:8.1f} KB")
print(f"tokens per rank where EP starts sending more than DP: T = P_layer / (2·k·d) = {P / layers / (2 * K * D):.0f}")

# %% [markdown]
# Measured from the traces: the all-to-alls of the training run (bytes each rank sent per step, the
# count exchanges included), and the all-reduce of section 4, issued on a tensor as large as all the
# expert gradients of one layer (times the number of layers for the whole model). Time is the
# median over calls, on a shared CPU, so read it loosely.

# %%
import statistics

run = trainings["balancing loss 0.1"]
steps = max(m["step"] for m in run.metrics if m["name"] == "loss") + 1
moved = {}
for e in run.comm_events(0, "all_to_all"):
    moved[e["args"]["moe"]] = moved.get(e["args"]["moe"], 0) + e["args"]["bytes_sent"] / steps
a2a_bytes = sum(moved.values())
a2a_time = sum(e["end"] - e["start"] for e in run.comm_events(0, "all_to_all")) / steps
reduces = [e for e in layer_run.comm_events(0, "all_reduce") if e["phase"] == "dp of experts"]
ar_bytes, ar_time = (
    reduces[-1]["args"]["bytes_sent"] * layers,
    statistics.median(e["end"] - e["start"] for e in reduces) * layers,
)
print("rank 0, bytes sent per step by role:", {k: f"{v / 1e3:.1f} KB" for k, v in moved.items()})
print(f"EP measured: all-to-alls  {a2a_bytes / 1e3:8.1f} KB per step, {a2a_time * 1e3:6.1f} ms")
print(
    f"DP measured: all-reduce   {ar_bytes / 1e3:8.1f} KB per step, {ar_time * 1e3:6.1f} ms  "
    f"(theory {dp_bytes / 1e3:.1f} KB)"
)

# %% [markdown]
# The measured all-to-all bytes sit near the balanced estimate (dropped choices do not travel; the
# rows a rank keeps for its own experts never leave it), under the capacity bound, and several times
# below what replicating the experts would send: here EP sends less *and* each rank stores only E/W
# of the experts. Scale the model up and the gap widens: P grows with E·d_model·d_ff, while the rows a
# rank moves depend only on its batch and d_model.
#
# The times need not follow the bytes. The all-to-alls are many small messages (five calls per layer
# per step, each a full collective round that pays latency and waits for the slowest rank), on the
# critical path between the router and the experts, with nothing to overlap them unless the schedule is
# pipelined (Tutel, FasterMoE); DP's one large all-reduce can hide behind backward, as DDP's buckets
# do. And EP inherits the skew of section 5: the rank holding the popular experts is the straggler.
#
# ## Questions
#
# 1. Section 1: with k = 1 and E = 64, how many times more parameters than the dense MLP does the MoE
#    MLP have, and how many more FLOPs per token?
# 2. Section 3: for the batch of section 2, what is the smallest factor f at which nothing is dropped?
#    Why is it larger than 1 even though the capacity is "enough on average"?
# 3. Section 4: why must every rank know the counts *before* the dispatch all-to-all? What would go
#    wrong with a fixed (E, C, d) buffer instead (hint: the padded rows)?
# 4. Section 6: at what batch size per rank would data parallelism of the experts send fewer bytes
#    than expert parallelism for this model? And for FasterMoE's MoE-GPT-S (H = 1024, FFN 2048, E = 16)?
