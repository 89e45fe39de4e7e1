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
# # 02 · Data parallelism: from one all-reduce per gradient to overlapped buckets
#
# In data parallelism every rank holds a full copy of the model and runs forward and backward on its own
# slice of the batch. The ranks then hold different gradients; averaging them gives every rank the
# gradient of the *whole* batch, so every rank takes the same optimizer step and the copies stay equal.
# Averaging is one collective, the **all-reduce** of notebook 01.
#
# How and *when* the gradients travel is the whole difference between a slow and a fast implementation.
# This notebook trains a small GPT on 2 real ranks (gloo on the CPU; the same code runs NCCL on GPUs) and
#
# 1. runs **naive data parallelism**: backward first, then one blocking all-reduce per gradient tensor;
# 2. explains, with the alpha-beta cost model, why **buckets** (fewer, larger messages) help, and why
#    launching them **from gradient hooks** lets communication hide behind the rest of backward;
# 3. runs **DDP** (buckets + overlap) and draws the timeline of one step on every rank, then measures the
#    overlap of both versions and the bytes each rank sends against the theory 2Ψ(N-1)/N;
# 4. sweeps the **bucket size**: number of collectives, step time, overlap;
# 5. uses **`no_sync`** for gradient accumulation, and measures what happens when it is misused: the
#    ranks' "identical" models drift apart.
#
# It runs top to bottom in about a minute on a 2-core laptop. Then do `labs/02-ddp-buckets`: you write
# the bucketing yourself and the grader checks it on real ranks.

# %%
import inspect
import statistics

import plotly.graph_objects as go
from plotly.subplots import make_subplots

import toolkit
from toolkit import viz
from toolkit.memory import alpha_beta_time, communication_per_step
from toolkit.parallel import ddp
from toolkit.run import Run
from toolkit.trace.analysis import bytes_per_step, overlap_fraction, step_windows
from toolkit.train import TrainConfig, build_model, launch_train

WORLD = 2  # ranks
BASE = dict(steps=5, global_batch_size=8, model=dict(n_layer=4, d_model=64), progress=False, sample_memory=False)
SMALL_BUCKETS_MB = 0.05  # about 52 KB: the model's 825 KB of gradients go in 13 buckets

model = build_model(TrainConfig(**BASE))
params = [p for p in model.parameters() if p.requires_grad]
PSI = sum(p.numel() for p in params)
print(
    f"tiny GPT: {len(params)} parameter tensors, Ψ = {PSI:,} parameters, "
    f"{4 * PSI / 1e3:.0f} KB of fp32 gradients per rank per step"
)

# %% [markdown]
# ## 1. Naive data parallelism
#
# The first version anyone writes: run backward as usual, then average every gradient, one all-reduce per
# parameter tensor. In the toolkit this is the `"dp"` strategy, and its whole communication is this loop
# (autograd calls it once backward is over):

# %%
print(inspect.getsource(ddp.NaiveDataParallel.finish_backward))

# %% [markdown]
# `launch_train` starts the ranks, runs the toolkit's one training loop on each
# (`loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()`) and returns one merged `Run`:
# every collective each rank issued (through `toolkit.comm`, which records it) and every
# forward / backward / optimizer span, on one clock.

# %%
dp_run = launch_train(TrainConfig(strategy="dp", **BASE), world_size=WORLD)


def per_step(run):
    """All-reduce calls (mean over the steps) and bytes rank 0 sent per step (median: the one-off
    broadcast of ddp's bucket rebuild, in step 1, is not a per-step cost)."""
    calls = sum(e["name"] == "all_reduce" and e["phase"] == "backward" for e in run.comm_events(0))
    sent = [s["total"] for s in bytes_per_step(run, 0)]
    return calls / len(sent), statistics.median(sent)


calls, sent = per_step(dp_run)
print(f"dp: {calls:.0f} all-reduces per step (one per parameter tensor), {sent / 1e3:.0f} KB sent per step by rank 0")
print("losses:", [round(v, 3) for _, v in dp_run.metric("loss")])

# %% [markdown]
# Correct, and wasteful in two ways:
#
# - **Nothing overlaps.** While backward computes, the network is idle; once it is over, the compute sits
#   idle while 52 all-reduces run one after the other.
# - **Many small messages.** Half of these 52 tensors are vectors of 64 floats, 256 bytes (LayerNorm
#   weights and biases, projection biases), and every message pays a fixed latency whatever its size.

# %% [markdown]
# ## 2. Why buckets, and why hooks
#
# **The alpha-beta model** (notebook 01): sending a message of M bytes costs about α + M·β, with α the
# latency of one message and β the time per byte. A ring all-reduce of M bytes over N ranks takes
# 2(N-1) steps and sends 2(N-1)/N · M bytes per rank:
#
# &nbsp;&nbsp;&nbsp;&nbsp;T(M) ≈ 2(N-1)·α + 2(N-1)/N · M · β
#
# Reducing k tensors one by one pays the latency term k times; the bandwidth term is the same whatever
# the grouping. So DDP copies gradients into a few flat **buckets** of about `bucket_cap_mb` each and
# all-reduces each bucket as one message. Below, the model's predicted communication time per step on 8
# ranks, with latency and bandwidth typical of a GPU cluster's network (α = 20 µs, 10 GB/s), as the
# bucket cap grows from "one tensor per message" to "everything in one message":

# %%
ALPHA, BETA, N_MODEL = 20e-6, 1 / 10e9, 8
sizes = [p.numel() * 4 for p in params]


def modelled_time(cap_bytes):
    buckets = ddp.assign_buckets(params, cap_bytes)
    return len(buckets), sum(
        alpha_beta_time("all_reduce", sum(sizes[i] for i in b), N_MODEL, ALPHA, BETA) for b in buckets
    )


print(f"{'bucket cap':>12} {'messages':>9} {'modelled time':>14}")
for cap in (1, 16e3, 64e3, 256e3, 1e9):
    count, seconds = modelled_time(cap)
    label = "per tensor" if cap == 1 else "one bucket" if cap == 1e9 else f"{cap / 1e3:.0f} KB"
    print(f"{label:>12} {count:>9} {seconds * 1e3:>11.2f} ms")

# %% [markdown]
# For this small model latency is most of the cost, and buckets cut it by the number of messages they
# save. (For a large model the bandwidth term dominates; buckets still remove the latency of the many
# small tensors, biases and norms.)
#
# But one giant bucket would have to wait for the *last* gradient before anything could travel. The second
# idea is **overlap**: backward produces gradients layer by layer, from the output back to the input. A
# hook on each parameter (`register_post_accumulate_grad_hook`) tells DDP the moment a gradient is final.
# When every gradient of a bucket is in, its all-reduce starts **asynchronously** (`async_op=True`) and
# backward carries on with earlier layers while the bytes travel. At the very end of backward DDP waits
# for the buckets still in flight and copies the averages back into `.grad`.
#
# For this to work the buckets are filled **in reverse registration order** (the last layers' parameters
# first): that is roughly the order in which backward finishes gradients, so bucket 0 fills first. Here
# are the model's buckets at a cap of 52 KB:

# %%
for k, bucket in enumerate(ddp.assign_buckets(params, SMALL_BUCKETS_MB * 2**20)):
    names = [name for i, (name, _) in enumerate(model.named_parameters()) if i in bucket]
    print(
        f"bucket {k:>2}: {sum(sizes[i] for i in bucket) / 1e3:5.1f} KB, params {bucket[0]:>2}..{bucket[-1]:<2} "
        f"({names[-1]} ... {names[0]})"
    )

# %% [markdown]
# (The tied token embedding, also the output head, is parameter 0: its gradient is final last, since the
# embedding lookup is the last thing backward reaches. It rides in the last bucket.)
#
# Registration order is only a guess. Like torch's DDP, the toolkit's records the order in which the
# first backward really made gradients ready and rebuilds the buckets in that order before the second
# step (rank 0's order, broadcast once, so every rank's buckets match: you will find that broadcast in
# step 1's trace). Here the guess is nearly right: backward finishes a LayerNorm's weight just before
# its bias. And with the default cap (25 MiB) the first bucket closes at 1 MiB, so the last layers'
# gradients leave without waiting for 25 MiB to fill. What else differs from torch: `docs/differences.md`.
#
# ## 3. DDP: buckets, overlapped, measured
#
# The same training, now with the `"ddp"` strategy and the bucket cap above.

# %%
ddp_run = launch_train(
    TrainConfig(strategy="ddp", options={"bucket_cap_mb": SMALL_BUCKETS_MB}, **BASE), world_size=WORLD
)
calls, sent = per_step(ddp_run)
print(f"ddp: {calls:.0f} all-reduces per step (one per bucket), {sent / 1e3:.0f} KB sent per step by rank 0")
same = max(abs(a - b) for (_, a), (_, b) in zip(dp_run.metric("loss"), ddp_run.metric("loss")))
print(f"largest difference between the dp and ddp losses: {same:.1e}")

# %% [markdown]
# Same losses (up to float rounding: the sums run in a different order), a quarter of the messages.
# Now **the timeline of one step** (step 3) on both ranks: compute below (forward, backward, optimizer,
# and `wait`, the time blocked on an unfinished all-reduce), communication above. Hover a bar for its
# size and duration; zoom with the mouse.

# %%
STEP = 3


def one_step(run, step=STEP):
    """A filter for the spans that start inside training step `step` of their own rank."""
    windows = {r: step_windows(run, r)[step] for r in run.ranks}
    return lambda e: windows[e["rank"]][0] <= e["start"] <= windows[e["rank"]][1]


viz.timeline(ddp_run, where=one_step(ddp_run), title=f"ddp, {WORLD} ranks, step {STEP}: buckets leave during backward")

# %% [markdown]
# The all-reduces start while the backward bar is still running: bucket 0 (the last layers) leaves first,
# and each later bucket as soon as backward has finished its gradients. Compare naive data parallelism,
# where every all-reduce waits for the end of backward and runs inside it, blocking:

# %%
viz.timeline(dp_run, where=one_step(dp_run), title=f"dp, {WORLD} ranks, step {STEP}: every all-reduce after backward")

# %% [markdown]
# **Overlap, measured.** From the trace, the *overlap fraction* is the share of the time a rank had a
# collective in flight during which it was also computing (time blocked inside a collective does not
# count as computing). We take it step by step and report the median over steps 1 to 4 (step 0 warms
# up), so that one step slowed down by something else on the machine does not decide the answer.
# **Bytes per step** come from the same trace; the theory is one ring all-reduce of all the gradients,
# 2Ψ(N-1)/N elements of 4 bytes, whether they travel one tensor at a time or in buckets.


# %%
def step_overlap(run):
    """Median over steps (after the first) of each step's overlap fraction, ranks pooled."""
    fractions = []
    for step in range(1, len(step_windows(run, 0))):
        keep = one_step(run, step)
        fractions.append(overlap_fraction(Run(run.config, [e for e in run.events if keep(e)], meta=run.meta)))
    return statistics.median(fractions)


def step_time(run):
    return statistics.median(v for s, v in run.metric("step_time") if s > 0)


theory = communication_per_step(PSI, WORLD, "ddp") * 4
print(f"{'':>4} {'overlap':>8} {'bytes/step (rank 0)':>20} {'theory 2Ψ(N-1)/N x 4 B':>23} {'step time':>10}")
for name, run in (("dp", dp_run), ("ddp", ddp_run)):
    print(
        f"{name:>4} {step_overlap(run):>8.0%} {per_step(run)[1]:>20,.0f} {theory:>23,.0f} "
        f"{step_time(run) * 1e3:>7.1f} ms"
    )

# %% [markdown]
# The bytes agree exactly with the theory for both: bucketing changes *how many* messages and *when*,
# never how much data. The overlap goes from nothing (dp blocks in every collective) to a real share
# with ddp.
#
# Why not 100%? The last bucket can only leave once backward is over, so its time is never hidden. And on
# this CPU, gloo moves bytes with the same two cores that compute, while the two ranks also drift a little
# apart, so a collective also waits for the slower rank. On GPUs NCCL runs on its own stream and
# links, and overlap is what lets data parallelism scale.

# %% [markdown]
# ## 4. How big should a bucket be?
#
# Small buckets leave early but pay the latency many times; big buckets pay it rarely but leave late (one
# bucket leaves only once the last gradient is final, with almost nothing of backward left to hide it).
# torch's default is 25 MiB, sized for GPU models with hundreds of megabytes of gradients; ours has
# 825 KB, so we sweep much smaller caps. One launch trains once per cap (the toolkit's `train` runs
# inside any `toolkit.launch`).

# %%
CAPS_MB = [0.01, 0.05, 0.25, 25]


def sweep(caps, base):
    from toolkit.train import TrainConfig, train

    return [train(TrainConfig(strategy="ddp", options={"bucket_cap_mb": cap}, **base)) for cap in caps]


per_rank = toolkit.launch(sweep, WORLD, args=(CAPS_MB, BASE))
sweep_runs = [Run.merge(runs[i] for runs in per_rank) for i in range(len(CAPS_MB))]

rows = []
for cap, run in zip(CAPS_MB, sweep_runs):
    calls, sent = per_step(run)
    rows.append((cap, calls, step_time(run), step_overlap(run), sent))
print(f"{'cap (MiB)':>9} {'all-reduces/step':>17} {'step time':>10} {'overlap':>8} {'bytes/step':>11}")
for cap, calls, seconds, overlap, sent in rows:  # not `step_time`: that would replace the function above
    print(f"{cap:>9} {calls:>17.0f} {seconds * 1e3:>7.1f} ms {overlap:>8.0%} {sent:>11,.0f}")

fig = make_subplots(rows=1, cols=3, subplot_titles=("all-reduces per step", "median step time (ms)", "overlap"))
labels = [f"{cap} MiB" for cap in CAPS_MB]
for col, values in enumerate(([r[1] for r in rows], [r[2] * 1e3 for r in rows], [r[3] for r in rows]), start=1):
    fig.add_trace(
        go.Bar(x=labels, y=values, showlegend=False, marker_color=viz.style.COMMUNICATION["all_reduce"]), row=1, col=col
    )
fig.update_xaxes(title_text="bucket cap")
fig.update_yaxes(tickformat=".0%", row=1, col=3)
fig.update_layout(height=330, template="plotly_white", margin=dict(t=50, b=40))
fig

# %% [markdown]
# What to read in it:
#
# - **Bytes**: the same in every row. The cap decides how the gradients are cut into messages, never how
#   many bytes travel.
# - **Collectives**: fewer as the cap grows, down to one.
# - **Overlap**: with one bucket its single all-reduce can only start with the very last gradient, so
#   little of backward is left to hide it behind.
# - **Step time**: do not be surprised if the biggest buckets win *here*. On this CPU, gloo moves the
#   bytes with the same two cores that compute, so hiding communication behind computation frees less
#   than on a GPU, while every collective pays a fixed cost (Python, the trace, gloo's handshake between
#   processes). The numbers come from a small shared machine: rerun the cell to see how much they move.
#   On GPUs, where NCCL runs on its own stream and the network is the bottleneck, the balance usually
#   tips towards a few medium-sized buckets: enough of them to start early, few enough to pay little latency.

# %% [markdown]
# ## 5. Gradient accumulation and `no_sync`
#
# To train with a batch larger than fits in memory, each rank runs several **micro-batches** and sums
# their gradients before one optimizer step (dividing each loss by the number of micro-batches M, so the
# sum is the mean). Reducing after *every* micro-batch would be correct but sends M times the bytes: only
# the sum matters. So DDP offers `no_sync()`: backwards inside it only accumulate local gradients; the
# next backward outside it all-reduces the accumulated sum, once. The right loop:
#
# ```python
# for micro, (x, y) in enumerate(micro_batches):
#     last = micro == M - 1
#     with contextlib.nullcontext() if last else model.no_sync():
#         (model(x, y) / M).backward()
# opt.step(); opt.zero_grad()
# ```
#
# Two easy ways to get it wrong, both silent (no error, no hang, the loss goes down):
#
# - **`no_sync` on every micro-batch** (for example, the `with` block wrapped around the whole loop).
#   Nothing is ever reduced: each rank steps with its own gradients, and the "replicas" drift apart.
# - **Only the last backward outside `no_sync`, but its forward inside.** Like torch's DDP, the toolkit
#   decides at *forward* time whether the coming backward synchronises, so a forward run under `no_sync`
#   followed by a backward outside it still skips the reduction.
#
# Below, every rank trains 6 steps of 4 micro-batches in each of four ways, and after every step we
# measure how far apart the two ranks' parameters are (max |θ_rank0 - θ_rank1|). The same function,
# run in this process on the whole batch with the `"local"` strategy, is the reference.

# %%
MODES = {
    "no_sync on the first M-1 (right)": "right",
    "no no_sync (right, M x the bytes)": "always_sync",
    "no_sync on every micro-batch (bug)": "never_sync",
    "last forward inside no_sync (bug)": "forward_inside",
}


def accumulate(mode, steps=6, micro_batches=4):
    """Train with gradient accumulation the way `mode` says; return parameters and all-reduce counts per step."""
    import contextlib

    import torch
    import torch.distributed as dist

    from toolkit.models import SyntheticCorpus, tiny_gpt
    from toolkit.parallel import full_state_dict, wrap
    from toolkit.trace import recorder

    distributed = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.manual_seed(0)
    model, opt = wrap(
        tiny_gpt(), "ddp" if distributed else "local", optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3)
    )
    corpus, history = SyntheticCorpus(), []
    quiet = model.no_sync if distributed else contextlib.nullcontext
    for step in range(steps):
        recorder.reset()
        x, y = corpus.batch(step, 16, rank=rank, world_size=world)
        for micro, (xm, ym) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
            last = micro == micro_batches - 1
            if mode == "forward_inside" and last:
                with quiet():
                    loss = model(xm, ym) / micro_batches
                loss.backward()  # outside no_sync, but the forward already decided
                continue
            skip = mode == "never_sync" or (mode in ("right", "forward_inside") and not last)
            with quiet() if skip else contextlib.nullcontext():
                (model(xm, ym) / micro_batches).backward()
        opt.step()
        opt.zero_grad()
        flat = torch.cat([t.detach().cpu().flatten() for t in full_state_dict(model).values()])
        history.append((flat, sum(e["name"] == "all_reduce" for e in recorder.events)))
    return history


def run_all_modes():
    return {label: accumulate(mode) for label, mode in MODES.items()}


accumulation = toolkit.launch(run_all_modes, WORLD)  # [rank 0's results, rank 1's results]
reference = accumulate("right")  # no ranks: "local" on the whole batch

print(
    f"{'':<36} {'all-reduces/step':>16} {'ranks apart after step 1':>25} {'after step 6':>13} {'rank 0 vs local':>16}"
)
drift = {}
for label in MODES:
    rank0, rank1 = accumulation[0][label], accumulation[1][label]
    drift[label] = [(a[0] - b[0]).abs().max().item() for a, b in zip(rank0, rank1)]
    off_local = (rank0[-1][0] - reference[-1][0]).abs().max().item()
    print(f"{label:<36} {rank0[0][1]:>16} {drift[label][0]:>25.1e} {drift[label][-1]:>13.1e} {off_local:>16.1e}")

fig = go.Figure()
for label, values in drift.items():
    fig.add_trace(go.Scatter(x=list(range(1, len(values) + 1)), y=values, mode="lines+markers", name=label))
fig.update_layout(
    title="How far apart the two ranks' parameters are after each step",
    xaxis_title="optimizer step",
    yaxis_title="max |θ rank 0 - θ rank 1|",
    height=380,
    template="plotly_white",
)
fig

# %% [markdown]
# Read the table:
#
# - **Right**: one set of bucket all-reduces per step (the last micro-batch's), ranks bit-for-bit equal, and
#   the same parameters as one process on the whole batch (up to float rounding).
# - **No `no_sync`**: also right, with 4 times the all-reduces and bytes. Correct but slow.
# - **`no_sync` on every micro-batch**: zero all-reduces. The ranks differ from the very first step and
#   drift further with every step: two different models, each trained on half the data.
# - **Last forward inside `no_sync`**: the backward ran outside the block and still sent nothing,
#   because the forward had already decided. Same drift.
#
# The two bugs are invisible in the loss curve (each rank's loss still falls). The cure is to test what
# data parallelism promises: the ranks' parameters are identical, and equal to one process trained on the
# whole batch. The toolkit's tests check exactly that for every strategy, and so does the lab's grader.

# %% [markdown]
# ## What to remember
#
# - Data parallelism averages gradients with an all-reduce: every rank sends 2Ψ(N-1)/N elements per step,
#   measured here exactly, whatever the bucketing.
# - **Buckets** turn many small messages into a few large ones: fewer latencies to pay.
# - **Hooks** launch each bucket the moment its gradients are final, so communication overlaps the rest
#   of backward; buckets go in reverse registration order because that is the order backward finishes them.
# - Bucket size trades latency (small buckets: many messages) against overlap (one bucket: none).
# - `no_sync` skips the reduction for accumulation micro-batches; misuse it and the replicas silently diverge.
#
# **Next:** `labs/02-ddp-buckets` (write the bucketing, the hook and the end-of-backward wait, graded on
# real ranks), then notebook 03, where ZeRO shards what data parallelism keeps N copies of.
