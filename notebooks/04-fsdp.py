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
# # 04 · FSDP: fully sharded data parallelism, one unit at a time
#
# ZeRO-3 (notebook 03) showed that data parallelism does not have to keep N copies of the model
# states: each rank can keep a 1/N slice of the parameters, gradients and optimizer states, and
# collectives bring a layer's parameters back for the moment it computes. PyTorch's **Fully Sharded
# Data Parallel** (FSDP; Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data
# Parallel", VLDB 2023) is that idea engineered for real models: the model is cut into **units**, each
# unit's parameters live in one flat, sharded tensor, and a schedule of all-gathers, frees and
# reduce-scatters walks through the units in forward and backward, prefetching the next one while the
# current one computes.
#
# This notebook runs it for real on 2 and 4 ranks (gloo on the CPU; the same code runs NCCL on GPUs):
#
# 1. **from DP to ZeRO-3 to FSDP**: what each keeps per rank, and what an FSDP unit is;
# 2. one launch that trains DDP, ZeRO-3 and FSDP side by side, with the same losses;
# 3. **the forward/backward workflow** of FSDP on the timeline of a real step, per rank;
# 4. **prefetching** on and off, side by side: timelines and step times;
# 5. **memory over time** through one step, every unit's gather and free visible, against the FSDP
#    paper's bound (sharded states + the unit(s) in flight);
# 6. **full versus hybrid sharding** on 4 ranks as 2 nodes x 2: bytes inside and across the nodes,
#    and when each wins at cluster scale (the paper's cross-host traffic formulas);
# 7. reasons to use FSDP, and reasons not to;
# 8. a **wrap-policy explorer**: choose the units and see their sizes, padding, peak memory and
#    number of collectives change.
# 9. **activation checkpointing** against stashing: the bytes saved and the computation paid; and
#    **fp16** with its loss scale, skipped steps included.
#
# It runs top to bottom in about a minute on a 2-core laptop. Then do `labs/03-fsdp-unit`: you write
# the unshard/reshard of a unit and its gradient reduce-scatter, and the grader trains with them.

# %%
import statistics

from IPython.display import HTML, display

import toolkit
from toolkit import viz
from toolkit.memory import activation_terms, communication_per_step, fsdp_cross_host_traffic, model_states
from toolkit.models import tiny_gpt
from toolkit.run import Run
from toolkit.sim import simulate
from toolkit.trace.analysis import step_windows
from toolkit.train import TrainConfig
from toolkit.viz.fsdp_explorer import gpt_models, policy_numbers, wrap_policy_explorer
from toolkit.viz.memory import memory_over_time

WORLD = 2  # ranks for sections 2-5
MODEL = dict(n_layer=4, d_model=64, n_head=4)  # vocab 64, sequence 32: the synthetic corpus's
BATCH = 64  # rows per step over all ranks (2 ranks: 32 each)
LINK = dict(bandwidth="25 MB/s", latency="50 us")  # the emulated link of sections 2-5
KB, MB, GB = 1e3, 1e6, 1e9


def show_table(rows):
    display(HTML(viz.table(rows)))


# %% [markdown]
# ## 1. From data parallelism to ZeRO-3 to FSDP
#
# Per parameter, mixed-precision Adam keeps 2 bytes of parameter, 2 of gradient and K = 12 of optimizer
# state (fp32 master copy, momentum, variance): **(2 + 2 + K)Ψ = 16Ψ bytes** of model states
# (in pure fp32 with AdamW: 4 + 4 + 8, the same 16). Per rank:
#
# | | keeps on every rank | communication per step |
# | --- | --- | --- |
# | data parallelism (DDP) | everything: 16Ψ | all-reduce of the gradients: 2Ψ(N-1)/N |
# | ZeRO-3 | a 1/N slice of everything: 16Ψ/N, plus whatever is gathered right now | all-gather in forward, again in backward, reduce-scatter: 3Ψ(N-1)/N |
# | FSDP | the same slices, plus the **unit(s)** gathered right now | the same 3Ψ(N-1)/N, one collective per unit |
#
# FSDP and ZeRO-3 save the same memory and move the same bytes. What FSDP adds is structure:
#
# - **Units.** A *wrap policy* chooses modules (here: every transformer block); each becomes a unit,
#   and the root (the whole model) is a unit too, holding what is left: the embeddings and the final norm.
#   A unit is gathered whole just before it computes and freed right after, so what a rank holds at any
#   moment is its shards plus the unit(s) in flight. The paper's words: memory "proportional to the size
#   of the sharded model plus the size of the largest fully-materialized FSDP unit".
# - **One flat parameter per unit.** A unit's tensors are laid end to end in one 1-D tensor, padded to
#   a multiple of N, and rank r keeps slice r. One unit = one all-gather and one reduce-scatter, however
#   many tensors it has; large messages use the link well. The module's own parameters stay in place as
#   *views* into the flat tensor, so the model's code runs unchanged.
# - **A schedule** that gathers the next unit while the current one computes (prefetch), frees
#   eagerly, and reduce-scatters a unit's gradients as soon as its backward is done.
#
# The toolkit's ZeRO-3 (notebook 03) works per *module* that owns parameters: 27 small units for this
# notebook's model, against FSDP's 5. The choice between one flat parameter per unit (FSDP1 and the
# paper, this toolkit) and **per-parameter dim-0 shards** (PyTorch's newer FSDP2, `fully_shard`):
# FSDP2 shards every tensor along its first dimension, so each rank holds whole rows of every weight,
# a real `DTensor` an optimizer or a checkpoint can read parameter by parameter; it copies the shards
# into a flat buffer around each collective. The flat parameter needs no copy and pads at most N-1
# elements per unit, but a rank's slice cuts through tensors anywhere, so only element-wise optimizers
# (Adam, SGD) can step it.
#
# FSDP's own planning code tells us the units without starting a single rank:

# %%
model = tiny_gpt(**MODEL)
PSI = model.num_params()
plan_numbers = policy_numbers(model, None, WORLD)
print(f"tiny GPT {MODEL}: Ψ = {PSI:,} parameters, sharded over N = {WORLD} ranks")
show_table(
    [
        {
            "unit": u["unit"],
            "tensors": u["tensors"],
            "elements": u["numel"],
            "padding": u["padding"],
            "elements per rank (shard)": u["shard_numel"],
        }
        for u in plan_numbers["units"]
    ]
)
print(
    f"model states per rank, 16 bytes per parameter: data parallelism {model_states(PSI) / KB:,.0f} KB, "
    f"fully sharded {model_states(PSI, WORLD, 3) / KB:,.0f} KB + the unit(s) in flight"
)

# %% [markdown]
# The token embedding is also the output head (tied weights). A unit is gathered only while its own
# module runs, so a weight used by two modules must belong to the **lowest common ancestor** unit of its
# users, whose forward encloses both uses: here that is the root. (A policy that makes `tok_emb` a unit
# of its own sees the weight moved up to the root.)
#
# ## 2. One launch: DDP, ZeRO-3 and FSDP on the same batches
#
# On one machine the ranks talk over loopback, which is nearly free, while they share two cores, so
# computing is slow: the opposite of a GPU cluster, where moving a unit's parameters takes about as long
# as computing with them. To see what prefetching is for, every collective here runs through the
# toolkit's **emulated link** (`toolkit.comm.emulate`): the bytes move for real, then the collective is
# held until an alpha-beta model of a 25 MB/s, 50 µs link says it may finish. Emulated waits appear on
# the timelines as "wait" spans.
#
# One `toolkit.launch` runs, on each of the 2 ranks: DDP and ZeRO-3 for 3 steps with the toolkit's
# training loop (`toolkit.train.train`), then FSDP for 18 steps with the loop written out below. The
# FSDP steps take turns between three prefetch settings (section 4), so that the machine's changing
# load hits all three alike: the two options are switches that every unit's hook reads
# (`model.engine.forward_prefetch`, `model.engine.backward_prefetch`), so one wrapped model can change
# them between steps. In the last round, `model.watch_memory()` samples the memory ledger at every
# gather, prefetch, free and reduce-scatter (section 5).

# %%
SETTINGS = {  # label -> (forward_prefetch, backward_prefetch)
    "no prefetch": (False, False),
    "backward prefetch (default)": (False, True),
    "forward + backward prefetch": (True, True),
}
ROUNDS = 6


def fsdp_rounds(rounds):
    """On every rank: FSDP on the tiny GPT, each round one step per prefetch setting; return this rank's Run."""
    import contextlib
    import functools
    import time

    import torch
    import torch.distributed as dist

    from toolkit.memory import ActivationMeter, record_memory
    from toolkit.models import SyntheticCorpus, tiny_gpt
    from toolkit.parallel import wrap
    from toolkit.run import Run
    from toolkit.trace.events import phase, recorder, span

    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = SyntheticCorpus(64, 32, 0)
    recorder.reset()
    torch.manual_seed(0)
    with phase("setup"):
        model, opt = wrap(tiny_gpt(**MODEL), "fsdp", optimizer=functools.partial(torch.optim.AdamW, lr=3e-3))
    meter = ActivationMeter(model)
    step = 0
    for r in range(rounds):
        for label, (forward, backward) in SETTINGS.items():
            model.engine.forward_prefetch, model.engine.backward_prefetch = forward, backward
            x, y = corpus.batch(step, BATCH, rank=rank, world_size=world)
            watching = r == rounds - 1
            dist.barrier()  # start the step together
            t0 = time.perf_counter()
            with model.watch_memory(meter=meter, step=step) if watching else contextlib.nullcontext():
                if watching:
                    record_memory(model, opt, step=step, meter=meter, event="start of step")
                with phase("forward"), span("forward", step=step), meter:
                    loss = model(x, y)
                with phase("backward"), span("backward", step=step):
                    loss.backward()
                with phase("optimizer"), span("optimizer", step=step):
                    opt.step()
                    opt.zero_grad()
                if watching:
                    record_memory(model, opt, step=step, meter=meter, event="after the optimizer step")
            recorder.metric("step_time", time.perf_counter() - t0, step=step)
            recorder.metric("loss", loss.item(), step=step)
            recorder.metric("setting", label, step=step)
            step += 1
    run = Run.capture({"strategy": "fsdp", "model": MODEL, "settings": list(SETTINGS)})
    run.meta["units"] = model.describe()
    weight, full = model.module.tok_emb.weight, model.full_state_dict()["tok_emb.weight"]  # between two steps
    run.meta["held"] = {"shape": tuple(weight.shape), "sum": weight.detach().sum().item(), "full": tuple(full.shape)}
    run.meta["held"]["full sum"] = full.sum().item()
    return run


def on_each_rank(configs, rounds):
    from toolkit.train import train

    return [train(c) for c in configs] + [fsdp_rounds(rounds)]


baselines = {
    name: TrainConfig(
        strategy=name,
        steps=3,
        global_batch_size=BATCH,
        model=dict(MODEL),
        progress=False,
        options={"bucket_cap_mb": PSI * 4 / 4 / 2**20} if name == "ddp" else {},
    )
    for name in ("ddp", "zero3")
}
with toolkit.comm.emulate(**LINK):
    per_rank = toolkit.launch(on_each_rank, WORLD, args=(list(baselines.values()), ROUNDS), quiet=True)
labels = list(baselines) + ["fsdp"]
runs = {label: Run.merge(ranks[i] for ranks in per_rank) for i, label in enumerate(labels)}
fsdp = runs["fsdp"]
setting_of = dict(fsdp.metric("setting"))
held = [ranks[-1].meta["held"] for ranks in per_rank]  # what each rank holds of a weight between steps (below)


def losses(run, steps=3):
    """The loss of the whole batch per step: the mean over the ranks of each rank's loss on its rows."""
    per_rank = [dict(run.metric("loss", r)) for r in run.ranks]
    return [statistics.fmean(rank[s] for rank in per_rank) for s in range(steps)]


show_table(
    [
        {"run": label, **{f"loss, step {s}": round(v, 6) for s, v in enumerate(losses(run))}}
        for label, run in runs.items()
    ]
)

# %% [markdown]
# The three strategies compute the same losses: they change where the bytes live and which collectives
# move them, not the arithmetic. (The FSDP steps 0-2 here ran with three different prefetch settings;
# prefetching changes *when* a unit is gathered, never its values. `tests/test_fsdp.py` checks the
# parameters against one process to 1e-5, at 2, 3 and 4 ranks.)
#
# What one step costs in collectives, from the traces (rank 0, the last step of each strategy; FSDP: a
# step with the default setting):


# %%
def window_of(run, step):
    """A predicate: did this event start inside step `step` of its own rank?"""
    windows = {rank: step_windows(run, rank)[step] for rank in run.ranks}
    return lambda e: windows[e["rank"]][0] <= e["start"] <= windows[e["rank"]][1]


def steps_with(label):
    return [s for s, setting in sorted(setting_of.items()) if setting == label]


DEFAULT, LAST_ROUND = "backward prefetch (default)", {label: steps_with(label)[-1] for label in SETTINGS}
rows = []
for label, run in runs.items():
    shown = LAST_ROUND[DEFAULT] if label == "fsdp" else len(step_windows(run, 0)) - 1
    inside = window_of(run, shown)
    calls = [e for e in run.comm_events(0) if inside(e)]
    count = {}
    for e in calls:
        count[e["name"]] = count.get(e["name"], 0) + 1
    theory = communication_per_step(PSI, WORLD, label) * 4
    rows.append(
        {
            "strategy": label,
            "collectives per step": ", ".join(f"{n} x {c}" for c, n in count.items()),
            "KB sent by rank 0": round(sum(e["args"]["bytes_sent"] for e in calls) / KB, 1),
            "theory KB": round(theory / KB, 1),
        }
    )
show_table(rows)

# %% [markdown]
# DDP sends 2Ψ(N-1)/N (all-reduces of gradient buckets), ZeRO-3 and FSDP 3Ψ(N-1)/N: each parameter is
# gathered in forward, gathered again in backward, and its gradient reduce-scattered. FSDP does it in
# 15 collectives (3 per unit, 5 units) where ZeRO-3 needs 81: each collective pays a latency, so on a
# real link fewer, larger messages win.
#
# Between two steps, what does a rank hold of a weight? Ask the module itself: `model.module.tok_emb.weight`
# on each rank, after the last step above.

# %%
show_table(
    [
        {"rank": r, "tok_emb.weight between steps": str(h["shape"]), "sum": round(h["sum"], 4)}
        for r, h in enumerate(held)
    ]
    + [
        {
            "rank": "full_state_dict()",
            "tok_emb.weight between steps": str(held[0]["full"]),
            "sum": round(held[0]["full sum"], 4),
        }
    ]
)
full_numel = held[0]["full"][0] * held[0]["full"][1]
assert held[0]["full"] == (64, 64) and 0 < held[1]["shape"][0] < held[0]["shape"][0] < full_numel == 4096
assert all(len(h["shape"]) == 1 for h in held) and sum(h["shape"][0] for h in held) == full_numel
assert abs(sum(h["sum"] for h in held) - held[0]["full sum"]) < 1e-3 and held[0]["shape"][0] > held[1]["shape"][0]

# %% [markdown]
# Each rank holds a 1-D piece of the 64 x 64 embedding, and the pieces add up to it: their lengths sum to
# its 4,096 values and their sums to its sum. They are not halves: the embedding is the first tensor of the
# root unit, whose flat parameter is cut in two, so rank 0's half is all embedding and rank 1's half holds
# the rest of it, then the position embedding and the final norm. This is FSDP1's `use_orig_params` view:
# between uses the module's parameters are this rank's pieces of its slice, updated in place by the
# optimizer. `model.state_dict()` refuses them (a checkpoint of pieces would load into nothing); the full
# tensors come from `model.full_state_dict()`, a gather on every rank.
#
# ## 3. The FSDP workflow on the timeline
#
# One step of the default setting on both ranks. Each rank has a communication lane (all-gathers
# green, reduce-scatters orange) above a compute lane, where the spans are FSDP's units
# (`forward blocks.0`, `backward blocks.3`, ...; `(root)` encloses everything) and "wait" is time spent
# waiting for the emulated link. Hover over a span for its unit, bytes and duration.
#
# - **Forward**, unit by unit: all-gather the unit's flat parameter (its shards from every rank), run
#   its forward, **free** the gathered copy (`reshard_after_forward=True`). The root is gathered first
#   and stays gathered while the blocks run inside it.
# - **Backward**, in reverse: when a unit's outputs receive their gradient, all-gather the unit
#   **again** (it was freed), compute its backward, free it, and **reduce-scatter** its gradient, so
#   each rank keeps the averaged gradient of its own slice only. After an all-gather, every rank holds
#   the same W_i; after the backward, each holds a different gradient G_i (its own rows of the batch):
#   the reduce-scatter averages them and hands out the slices.
# - **Backward prefetch** (on by default): as a unit's backward starts, the all-gather of the unit that
#   backward reaches next is issued, before this unit's reduce-scatter.
# - **Optimizer**: AdamW steps the fp32 slices only; nothing is gathered until the next forward.


# %%
def no_outer_spans(where):
    """Keep the units' spans; drop the loop's own 'forward'/'backward' spans that enclose them."""
    return lambda e: where(e) and not (e["cat"] == "compute" and e["name"] in ("forward", "backward"))


step = LAST_ROUND[DEFAULT]
viz.timeline(
    fsdp,
    where=no_outer_spans(window_of(fsdp, step)),
    title=f"FSDP, one step on {WORLD} ranks (backward prefetch), emulated {LINK['bandwidth']} link",
)

# %% [markdown]
# The order of events on rank 0 in that step, as FSDP's memory probe saw them (the next section plots
# the memory at each of these moments):

# %%
events = [s["event"] for s in fsdp.samples if s["rank"] == 0 and s["step"] == step]
print(" -> ".join(events))

# %% [markdown]
# ## 4. Prefetching: the next unit's all-gather behind the current unit's compute
#
# Without prefetch, a unit's all-gather starts when the unit is needed, and the rank waits for it. With
# **forward prefetch**, when unit i starts computing, the all-gather of unit i+1 (in the order the last
# forward ran) is issued, so the bytes travel while unit i computes. **Backward prefetch** does the same
# in backward: when unit i's backward starts, unit i-1's all-gather is issued, *before* unit i's
# reduce-scatter, which would otherwise occupy the link first (the paper's "issue the all-gather before
# the reduce-scatter"). The price: one more unit gathered at a time.
#
# The same step with no prefetch and with both, rank 0 (same time scale):

# %%
figures = []
for label in ("no prefetch", "forward + backward prefetch"):
    s = LAST_ROUND[label]
    fig = viz.timeline(fsdp, ranks=[0], where=no_outer_spans(window_of(fsdp, s)), title=f"rank 0, {label}")
    figures.append(fig)
longest = max(max(b + x for t in f.data for b, x in zip(t.base, t.x)) for f in figures)
for fig in figures:
    fig.update_xaxes(range=[0, longest * 1.02])
    fig.update_layout(height=230)
    display(fig)

# %% [markdown]
# Step times of all 18 FSDP steps, grouped by setting (both ranks; each setting had 6 steps, taken in
# turns), and the time a rank spent in "wait" spans, held back by the emulated link after its compute
# was done (the median over the setting's steps on rank 0):


# %%
def link_wait(run, step, rank=0):
    inside = window_of(run, step)
    return sum(e["end"] - e["start"] for e in run.events if e["rank"] == rank and e["cat"] == "wait" and inside(e))


rows, medians = [], {}
for label in SETTINGS:
    steps = set(steps_with(label))
    times = [v for r in fsdp.ranks for s, v in fsdp.metric("step_time", r) if s in steps]
    medians[label] = statistics.median(times)
    waits = [link_wait(fsdp, s) for s in steps]
    rows.append(
        {
            "setting": label,
            "median step ms": round(medians[label] * 1e3, 1),
            "fastest ms": round(min(times) * 1e3, 1),
            "waiting for the link, ms (median)": round(statistics.median(waits) * 1e3, 1),
            "vs no prefetch": f"{medians['no prefetch'] / medians[label]:.2f}x",
        }
    )
show_table(rows)

# %% [markdown]
# Prefetching hides communication behind compute: the time spent waiting for the link shrinks and the
# step gets faster. Backward prefetch issues a unit's all-gather *before* the current unit's
# reduce-scatter; without it, the all-gather queues behind the reduce-scatter on the one link while
# backward has nothing left to compute. Forward prefetch overlaps each block's all-gather with the
# forward of the block before. Neither can hide more than the compute it overlaps with: an all-gather
# that takes longer than the unit before it still shows as a wait, and communication overlapping
# communication gains nothing. (On two shared cores single step times are noisy, which is why the
# settings took turns and the table shows medians. Run the launch again and the numbers move, and so
# does how much each prefetch adds; prefetching against none does not.)
#
# ## 5. Memory over time, against the FSDP paper's bound
#
# In the last round, `model.watch_memory()` took a ledger sample at every gather, prefetch, free and
# reduce-scatter: parameters (the fp32 shards, which are also the master weights, plus whatever unit is
# gathered), gradients (the shards' averaged gradients, plus a unit's full gradient while it is
# collected and reduce-scattered), optimizer states (AdamW's two moments, per shard) and activations.
# Below, one step of the default setting, per rank. ▲ marks a unit gathered, ▶ a prefetch issued, ▼ a
# unit freed, × a reduce-scatter issued: hover for the unit.
#
# The dashed line is the bound on the **model states** (params + grads + optimizer): the shards of
# everything (16 bytes per element: master 4, gradient 4, AdamW 8, on 1/N of each padded unit), plus
# what is whole at once: the root (gathered through the whole step, and its full gradient through
# backward), two blocks gathered (one computing, one prefetched) and two blocks' full gradients (one
# filling, one being reduce-scattered). The wrap-policy explorer of section 8 computes it from the units.

# %%
bounds = {
    label: policy_numbers(model, None, WORLD, prefetch=label != "no prefetch")["memory"]["peak"] for label in SETTINGS
}
memory_over_time(
    fsdp,
    step=step,
    categories=("params", "grads", "optimizer", "activations", "states"),
    bound=bounds[DEFAULT],
    bound_label="bound on model states",
    title=f"Memory through one FSDP step (backward prefetch), per rank, Ψ = {PSI:,}",
)

# %% [markdown]
# Read it left to right: the parameters rise by a block (200 KB) at each ▲ and fall back at each ▼, one
# block at a time in forward while the activations pile up; in backward two blocks are up at once (the
# prefetched one), the activations drain, and the gradients jump by a block as each unit's full
# gradient is collected; that full gradient goes once its reduce-scatter has finished (at the next
# unit's turn), leaving a slice. The model states stay under the bound throughout.
#
# The parameter bytes alone make the bound exact: shards (4 bytes x Σψ_i/N) + the root (4 bytes x ψ_root,
# gathered all step long) + k blocks gathered (k = 1 without prefetch, 2 with: the paper's "largest
# unit(s) in flight"):

# %%
units = fsdp.meta["units"]
root, block = units[0]["padded_numel"], max(u["padded_numel"] for u in units[1:])
shards = sum(u["padded_numel"] for u in units) // WORLD
rows = []
for label in SETTINGS:
    s = LAST_ROUND[label]
    in_step = [x for x in fsdp.samples if x["step"] == s]
    k = 1 if label == "no prefetch" else 2
    params_bound = 4 * (shards + root + k * block)
    for rank in fsdp.ranks:
        mine = [x for x in in_step if x["rank"] == rank]
        params = max(x["params"] for x in mine)
        states = max(x["params"] + x["grads"] + x["optimizer"] for x in mine)
        rows.append(
            {
                "setting": label,
                "rank": rank,
                "k": k,
                "peak params KB": round(params / KB, 1),
                "4(Σψ/N + ψ_root + k·ψ_block) KB": round(params_bound / KB, 1),
                "peak model states KB": round(states / KB, 1),
                "bound KB": round(bounds[label] / KB, 1),
                "states / bound": round(states / bounds[label], 3),
            }
        )
show_table(rows)
ddp_states = model_states(PSI, 1, 0, param_bytes=4, grad_bytes=4, optimizer_multiplier=8)
print(f"data parallelism would hold {ddp_states / KB:,.0f} KB of model states on every rank (16 bytes x Ψ)")

# %% [markdown]
# The peak parameter bytes match the bound to the byte: prefetching costs exactly one more block. The
# model states peak somewhat under their bound, which assumes every gradient slice and two full block
# gradients are present at the same moment. With N = 2 the shards are half the model, so FSDP saves
# less than half here; with N = 64 the shards shrink 32 times more and the units in flight dominate,
# which is why the unit size (the wrap policy, section 8) matters.
#
# One more step, no prefetch, parameters only: one block at a time, and the line never crosses
# 4(Σψ/N + ψ_root + ψ_block).

# %%
k1 = 4 * (shards + root + block)
memory_over_time(
    fsdp,
    rank=0,
    step=LAST_ROUND["no prefetch"],
    categories=("params",),
    bound=k1,
    bound_label="4(Σψ/N + ψ_root + ψ_block)",
    title="Parameters through one step without prefetch, rank 0",
)

# %% [markdown]
# On a GPU this bound needs help that the CPU does not. There the CPU only *issues* kernels and runs ahead
# of the device: it could issue the all-gathers of unit after unit while the device is still computing
# the first, and the caching allocator cannot reuse a unit's memory while a collective on another stream
# may still touch it, so gathered units would pile up. torch's FSDP therefore has a **rate limiter**
# (`limit_all_gathers=True`, its default): before issuing an all-gather, the CPU waits until the unit two
# back has really been freed, so at most two units are in flight. The toolkit's FSDP does not have one.
# On the CPU it needs none (a unit's forward has finished before the next unit's hook runs, which is why
# the peak above is exact), but on GPUs its peak can exceed the bound; asking for `limit_all_gathers=True`
# is an error that says so. Every such difference from torch and DeepSpeed: `docs/differences.md`.

# %% [markdown]
# ## 6. Full sharding versus hybrid sharding
#
# Full sharding spreads every unit over all W ranks: the least memory, but every all-gather and
# reduce-scatter spans the whole cluster, so it crosses the slow links between hosts. **Hybrid
# sharding** (HSDP) shards each unit over a *sharding group* of F ranks, typically the G GPUs of one
# host, and **replicates** across the W/F groups. Per step a unit is all-gathered (twice) and
# reduce-scattered *inside* its group, over the fast intra-host links; then each rank's gradient slice
# is all-reduced with the ranks holding the same slice in the other groups, the only traffic that
# leaves the host. Memory: model states 16Ψ/F instead of 16Ψ/W.
#
# The paper's cross-host traffic per GPU per step, for a model of M bytes, G GPUs per host, W GPUs:
#
# | sharding | cross-host traffic per GPU |
# | --- | --- |
# | full replication (DDP) | 2M(W-1)/W |
# | full sharding | 3M(W-1)/W |
# | hybrid, sharded within a host | 2M(W-1)/(GW) |
#
# (The hybrid line is the paper's; an exact count, a ring all-reduce of the M/G slice over the W/G
# replicas, gives 2M(W-G)/(GW), the same once W >> G.)
#
# Measured: 4 ranks as 2 emulated hosts of 2 (ranks 0-1 and 2-3), links inside a host at 1 GB/s,
# between hosts at 10 MB/s. DDP, FSDP with full sharding (F = 4) and hybrid sharding (F = 2, groups
# {0, 1} and {2, 3}, replicas {0, 2} and {1, 3}), 3 steps each, with the toolkit's training loop.

# %%
W4, G = 4, 2
configs4 = {
    "DDP (full replication)": ("ddp", {"bucket_cap_mb": PSI * 4 / 4 / 2**20}),
    "FSDP, full sharding": ("fsdp", {}),
    "FSDP, hybrid 2 x 2": ("fsdp", {"sharding_group_size": 2}),
}


def train_each(configs):
    from toolkit.train import train

    return [train(c) for c in configs]


configs = [
    TrainConfig(strategy=s, steps=3, global_batch_size=32, model=dict(MODEL), options=o, progress=False)
    for s, o in configs4.values()
]
with toolkit.comm.emulate(bandwidth="10 MB/s", latency="100 us", intra_node=("1 GB/s", "10 us"), ranks_per_node=G):
    per_rank = toolkit.launch(train_each, W4, args=(configs,), quiet=True)
runs4 = {label: Run.merge(ranks[i] for ranks in per_rank) for i, label in enumerate(configs4)}

M = PSI * 4  # the model's bytes in fp32
formula = {
    "DDP (full replication)": fsdp_cross_host_traffic(M, G, W4, "full_replication"),
    "FSDP, full sharding": fsdp_cross_host_traffic(M, G, W4, "full_shard"),
    "FSDP, hybrid 2 x 2": fsdp_cross_host_traffic(M, G, W4, "hybrid"),
}
rows = []
for label, run in runs4.items():
    last = window_of(run, len(step_windows(run, 0)) - 1)
    inside = across = 0
    for e in run.comm_events(0):
        if last(e):
            if e["args"].get("link") == "intra-node":
                inside += e["args"]["bytes_sent"]
            else:
                across += e["args"]["bytes_sent"]
    groups = sorted({(e["name"], tuple(e["args"]["group"])) for e in run.comm_events(0) if last(e)})
    rows.append(
        {
            "run": label,
            "collectives (group)": ", ".join(f"{n} {list(g)}" for n, g in groups),
            "KB within a host": round(inside / KB, 1),
            "KB across hosts": round(across / KB, 1),
            "paper's formula KB": round(formula[label] / KB, 1),
            "median step ms": round(statistics.median(v for _, v in run.metric("step_time")) * 1e3, 1),
            "final loss": round(run.metric("loss")[-1][1], 6),
        }
    )
show_table(rows)
print(f"exact hybrid count 2M(W-G)/(GW) = {2 * M * (W4 - G) / (G * W4) / KB:.1f} KB")
step_ms = {r["run"]: r["median step ms"] for r in rows}
print(
    f"hybrid: {step_ms['FSDP, full sharding'] / step_ms['FSDP, hybrid 2 x 2']:.2f}x the speed of full sharding, "
    f"{step_ms['DDP (full replication)'] / step_ms['FSDP, hybrid 2 x 2']:.2f}x the speed of DDP"
)

# %% [markdown]
# Same loss three ways, and the bytes across hosts are the formulas' (hybrid: the exact count). Full
# sharding sends the most across hosts, 3M(W-1)/W, and is the slowest; hybrid sharding sends only its
# slices' all-reduce across, a third of what DDP sends, and does the rest over the fast link, so it
# is the fastest of the three. In memory, hybrid pays for it: each rank holds 1/2 of the model states
# instead of 1/4.
#
# **When does each win?** The answer is in two numbers: the cross-host traffic (time), and whether
# the model states sharded over one host still fit (memory). On realistic numbers (bf16 parameters, M =
# 2Ψ bytes on the wire; 16Ψ bytes of model states; hosts of G = 8 GPUs of 80 GB, W = 512; 50 GB/s of
# network per GPU):

# %%
G8, W512, NET = 8, 512, 50e9
rows = []
for name, psi in (("1.3B", 1.3e9), ("7B", 7e9), ("13B", 13e9), ("70B", 70e9), ("175B", 175e9)):
    M_bf16 = 2 * psi
    row = {"model": name}
    for label, sharding, F in (
        ("DDP", "full_replication", 1),
        ("full shard", "full_shard", W512),
        ("hybrid", "hybrid", G8),
    ):
        states = model_states(psi, F, 3 if F > 1 else 0) / GB
        seconds = fsdp_cross_host_traffic(M_bf16, G8, W512, sharding) / NET
        row[f"{label}: GB per GPU"] = round(states, 1)
        row[f"{label}: s per step across hosts"] = round(seconds, 2)
    fits = [
        label
        for label, F in (("hybrid", G8), ("full shard", W512), ("DDP", 1))
        if model_states(psi, F, 3 if F > 1 else 0) <= 0.6 * 80 * GB
    ]  # leave 40% for activations
    row["verdict"] = fits[0] if fits else "needs more than data parallelism (tensor/pipeline parallel)"
    rows.append(row)
show_table(rows)

# %% [markdown]
# Hybrid sharding sends 12 times less across hosts than full sharding at these sizes (2/(3G) of it), so
# it wins **whenever the model states sharded over one host fit** with room for activations: 16Ψ/8 ≤ 48 GB,
# up to about 24B parameters on 8 x 80 GB. Beyond, only full sharding fits (at W = 512, even 175B takes 5.5 GB per GPU),
# and its cross-host traffic is the price, which prefetching hides if each unit computes long enough.
# (DDP never wins here: it fits only the smallest model and still sends 2M across hosts.) In between,
# hybrid sharding over 2 hosts (F = 16) trades some of each. Tight on memory: full; tight on network:
# hybrid.
#
# **Gradient accumulation: hold the gradients, or reduce every micro-batch.** A step of several micro-batches
# gathers each unit in every micro-batch's forward and backward. Its gradients can be reduce-scattered after each
# micro-batch (added into the slices), or kept whole inside `model.no_sync()` until the last one, which reduces
# the sum once: fewer bytes, and every unit's whole gradient in memory meanwhile. `toolkit.train` runs all but a
# step's last micro-batch inside `no_sync()` (`TrainConfig.no_sync`); Composer's trainer runs FSDP the other way.
# The simulator runs either (`simulate(..., accumulation=, no_sync=)`), here on section 2's model, 4 micro-batches:

# %%
rows = []
for label, no_sync in (("whole gradients until the last (no_sync)", True), ("reduce-scatter every micro-batch", False)):
    sim = simulate(
        lambda: tiny_gpt(**MODEL),
        "fsdp",
        WORLD,
        batch_per_rank=BATCH // WORLD,
        accumulation=4,
        no_sync=no_sync,
        progress=False,
    )
    rows.append(
        {
            "4 micro-batches a step": label,
            "KB sent per step": round(sim.bytes_per_step["total"] / KB, 1),
            "formula KB": round(sim.theory()["bytes_per_step"] / KB, 1),
            "peak KB": round(sim.peak / KB, 1),
        }
    )
show_table(rows)
kept_whole, reduced_each = rows
sent, peak = (kept_whole[k] / reduced_each[k] for k in ("KB sent per step", "peak KB"))
print(f"no_sync sends {sent:.2f}x the bytes, at {peak:.2f}x the peak")
assert all(r["KB sent per step"] == r["formula KB"] for r in rows)
assert abs(sent - 9 / 12) < 0.01 and peak > 1

# %% [markdown]
# Held back, the step moves 9 passes of the model instead of 12 (8 gathers either way, then one reduce-scatter
# instead of four: `communication_per_step(..., accumulation=4, no_sync=True)`), and its peak is higher: it holds
# every unit's whole gradient where the other holds this rank's slice. ZeRO-2 and ZeRO-3 have no such choice: they keep only a slice of the gradients, so each
# micro-batch reduce-scatters into it.
#
# ## 7. Reasons to use FSDP, and reasons not to
#
# **Use it when**
#
# - the model states do not fit one GPU under data parallelism: FSDP trains models roughly N times larger,
#   by trading communication (1.5x DDP's bytes) for memory; the paper trains up to 175B-parameter GPTs
#   and reports about 5x larger models than DDP before running out of memory;
# - you want data parallelism's programming model: the training loop does not change; wrapping the model
#   and saving/loading checkpoints (full or sharded state dicts) are the only code changes;
# - the network is fast enough, or the units compute long enough, that prefetching hides the all-gathers
#   (large batches, large units); hybrid sharding when the cross-host network is the bottleneck.
#
# **Think twice when**
#
# - the model is small (below about 100 million parameters, where DDP fits easily): FSDP then only adds
#   50% more communication and many small collectives. Activation checkpointing, or a smaller batch per GPU
#   with gradient accumulation, is often the better fix for memory there;
# - activations, not model states, fill the memory: FSDP shards model states only (combine it with
#   activation checkpointing: the toolkit's `activation_checkpointing=True` per unit, section 9);
# - the wrap policy is hard to get right: a generic policy (every module above some size) is simple
#   but can leave tiny units (latency-bound collectives) or huge ones (high peak); an architecture-aware
#   policy (one unit per block) is better and needs to know the model. Shared weights must live in
#   their lowest common ancestor unit;
# - precision: bf16 (Ampere or newer) is simple; fp16 needs a *sharded* gradient scaler, since no rank
#   sees every gradient to check for overflow (the toolkit has one: section 9);
# - partial fine-tuning (frozen and trainable parameters in one unit), non-elementwise optimizers (a
#   flat shard cuts through tensors), or code that reads parameters outside the unit's forward need care.
#
# ## 8. The wrap-policy explorer
#
# How the model is cut into units decides the peak memory (the largest units in flight), the padding
# (< N elements per unit) and the number of collectives (3 per unit per step). The explorer runs
# FSDP's own planning code (`fsdp_policy.plan`, the same the runs above used) on one process, on the
# tiny GPT of this notebook or on GPT-2 sizes built on the meta device (shapes only, no memory), and
# predicts the peak model states per rank as in section 5 (fp32, AdamW). Check it against the
# measurement first:

# %%
predicted = policy_numbers(model, None, WORLD, prefetch=True)
measured = max(x["params"] + x["grads"] + x["optimizer"] for x in fsdp.samples if x["step"] == step)
calls = sum(1 for e in fsdp.comm_events(0) if window_of(fsdp, step)(e))
print(
    f"tiny GPT on {WORLD} ranks, one unit per block, prefetch: predicted peak "
    f"{predicted['memory']['peak'] / KB:.1f} KB, measured {measured / KB:.1f} KB; "
    f"{predicted['collectives']['total']} collectives per step predicted, {calls} measured"
)

# %% [markdown]
# Things to try:
#
# - GPT-2 small, N = 8, each block versus each Linear layer versus the whole model: what happens to
#   the peak, to the number of collectives and to the share of latency in their time?
# - Min params per unit: slide from 10^4 to 10^8 on GPT-2 XL. Where is the peak lowest? Why does it
#   go up again on both sides?
# - GPT-2 small with each block as a unit: the root is the largest unit. Why (look at its elements)?
#   What would you change?
# - Raise N to 1024: which part of the peak is left, and what does that say about the unit size?

# %%
explorer = wrap_policy_explorer(gpt_models(), world_size=8)
print(explorer.text)
explorer

# %% [markdown]
# ## 9. Activation checkpointing: memory for compute; and fp16
#
# FSDP shards the model states; the activations stay whole on every rank (notebook 03, section 9, counted
# them: s·b·h·(34 + 5·a·s/h) bytes per layer in the paper's model). **Stashing**, the default, keeps
# every tensor the forward saves until backward uses it. **Checkpointing** keeps only each block's input:
# with `activation_checkpointing=True` every unit but the root runs its forward under
# `torch.utils.checkpoint` (non-reentrant), and in backward, once FSDP has gathered the unit again (as it
# does anyway), autograd runs the block's forward a second time and backward proceeds through the
# recomputed tensors, one block at a time.
#
# One launch on 2 ranks trains this notebook's model five steps each way (and a third, in between: below), times
# the middle three and
# counts both sides of the trade in the last, on rank 0, with `toolkit.memory.pass_costs`: the bytes
# kept from forward to backward (an `ActivationMeter`) and the floating-point operations of each pass
# (torch's `FlopCounterMode`, which counts the matmuls; the fused attention kernel is not in its table
# on the CPU). The same launch trains a few fp16 steps, for what follows (on 4 rows per rank: the CPU
# has no fast fp16 matmul).


# %%
def stash_or_recompute(steps=5):
    """On every rank: FSDP with and without activation checkpointing, then fp16; return what was counted."""
    import functools
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from toolkit.memory import pass_costs
    from toolkit.models import SyntheticCorpus, tiny_gpt
    from toolkit.parallel import wrap
    from toolkit.train import TrainConfig, train

    rank, world = dist.get_rank(), dist.get_world_size()
    corpus, out = SyntheticCorpus(64, 32, 0), {}
    for checkpointing in (False, True, 2):  # 2: every second block
        torch.manual_seed(0)
        model, opt = wrap(
            tiny_gpt(**MODEL),
            "fsdp",
            optimizer=functools.partial(torch.optim.AdamW, lr=3e-3),
            activation_checkpointing=checkpointing,
        )
        times = []
        for step in range(steps):
            x, y = corpus.batch(step, BATCH, rank=rank, world_size=world)
            dist.barrier()
            t0 = time.perf_counter()
            if step < steps - 1:  # timed steps (the first one warms up)
                model(x, y).backward()
            else:  # the last step, counted: bytes kept, FLOPs of each pass
                cost = pass_costs(model, x, y)
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
        out[checkpointing] = {**cost, "step": statistics.median(times[1:-1])}
    out["fp16"] = train(
        TrainConfig(
            strategy="fsdp",
            steps=4,
            global_batch_size=8,
            model=dict(MODEL),  # fp16
            options={"mixed_precision": "fp16"},
            progress=False,
            sample_memory=False,
        )
    )
    return out


ckpt_ranks = toolkit.launch(stash_or_recompute, WORLD, quiet=True)
stash, recompute, every_second = (ckpt_ranks[0][k] for k in (False, True, 2))
S, B = 32, BATCH // WORLD
per_block = sum(
    activation_terms(
        S,
        B,
        MODEL["d_model"],
        MODEL["n_head"],
        bytes_per_value=4,
        dropout=False,
        fused_attention=True,
        small_terms=True,
    ).values()
)
saving = MODEL["n_layer"] * (per_block - 4 * S * B * MODEL["d_model"])  # each block keeps its input, 4·sbh
show_table(
    [
        {
            "activations": label,
            "kept from forward to backward, KB": round(r["kept"] / KB, 1),
            "forward MFLOP": round(r["forward"] / 1e6, 1),
            "backward MFLOP": round(r["backward"] / 1e6, 1),
            "median step ms": round(r["step"] * 1e3, 1),
            "loss, last step": round(r["loss"], 6),
        }
        for label, r in (
            ("stashed (default)", stash),
            ("checkpointed", recompute),
            ("every second block checkpointed", every_second),
        )
    ]
)
print(
    f"one block saves {per_block / KB:,.0f} KB for backward; its input is {4 * S * B * MODEL['d_model'] / KB:,.0f} KB"
)
print(
    f"saved: {(stash['kept'] - recompute['kept']) / KB:,.1f} KB measured, {saving / KB:,.1f} KB predicted "
    f"(L x (one block's terms - its input)); backward paid {recompute['backward'] / stash['backward'] - 1:+.0%} "
    f"FLOPs, the step {recompute['step'] / stash['step'] - 1:+.0%} time"
)
print(
    f"every second block: saved {(stash['kept'] - every_second['kept']) / KB:,.1f} KB, backward paid "
    f"{every_second['backward'] / stash['backward'] - 1:+.0%} FLOPs"
)
assert stash["kept"] - recompute["kept"] == saving  # to the byte
assert 2 * (stash["kept"] - every_second["kept"]) == stash["kept"] - recompute["kept"]  # half the saving,
assert 2 * (every_second["backward"] - stash["backward"]) == recompute["backward"] - stash["backward"]  # half the cost
assert stash["loss"] == recompute["loss"] == every_second["loss"]

# %% [markdown]
# The saving is the prediction to the byte: each block keeps only its input instead of everything its
# operations saved (the root's embeddings and logits are stashed either way). The price is a second
# forward of each block inside backward, about a third more backward FLOPs here: a forward costs about
# half a backward, the root is not recomputed, and torch stops recomputing once it has every tensor
# backward needs (a block's last matmul is never rerun). Over a whole step that is the textbook "one more
# forward", up to 4/3 of the computation. On these two shared cores the step time hardly follows (a step
# of this tiny model is mostly hooks, Python and gloo, and the timings are noisy); on a GPU, where the
# matmuls are the step, it does. Both runs compute the same losses: a recomputation gives back the very
# tensors stashing kept. During backward one recomputed block is alive at a time, so the peak is what is
# kept plus one block's activations.
#
# The trade need not be all or nothing. `activation_checkpointing=2` checkpoints every second block (here
# blocks 2 and 4 of 4) and stashes the others: exactly half the saving for exactly half the recomputed
# FLOPs, and `k` in general recomputes one block in k. That is fms-fsdp's `selective_checkpointing` and
# torchtitan's layer-wise selective checkpointing; IBM trained a 13B Llama so on 128 A100s
# (`bench/published_runs.py` prices that run: docs/benchmarks.md).
#
# That trade is usually a good one for large models: notebook 03 found 275 GB of activations per row of
# GPT-3 against 4.8 GB with checkpointing, for about a third more computation. FSDP and checkpointing
# compose: the one shards what the other does not touch.
#
# **fp16.** bf16 keeps fp32's exponent range, so gradients do not underflow; fp16 stops at 6e-8, and
# gradients of large models are often smaller. The cure is **dynamic loss scaling**: gradients of S·loss
# instead of the loss, divided by S again in fp32 before the step. An overflow (S too large) makes some
# gradient inf: the step is skipped and S halves; S doubles after 2000 good steps. Under FSDP each rank
# holds only its slice of the gradient, so an overflow can be visible to one rank alone: the ranks
# all-reduce their "found inf" flag before deciding, so all step or all skip (torch's
# `ShardedGradScaler`). The toolkit's strategies do this themselves for `mixed_precision="fp16"`, and the
# Run records the scale and the skipped steps:

# %%
fp16 = Run.merge(rank["fp16"] for rank in ckpt_ranks)
show_table(
    [
        {"step": step, "loss scale": scale, "skipped": bool(skipped), "loss": round(loss, 4)}
        for (step, scale), (_, skipped), (_, loss) in zip(
            fp16.metric("loss_scale", 0), fp16.metric("skipped_step", 0), fp16.metric("loss", 0)
        )
    ]
)

# %% [markdown]
# The first step is skipped: the model's loss is itself fp16, and its own gradient, S = 2^16 = 65536, is
# above fp16's largest number, 65504. At 2^15 everything fits, and training goes on; torch's GradScaler
# does exactly this. DeepSpeed would not halve yet: its default hysteresis of 2 lets the first overflow
# skip the step at the same S ("but hysteresis is 2. Reducing hysteresis to 1"), so this model would skip
# its second step too, and only then go on at 2^15. The seed lecture's advice stands: prefer bf16 where
# the hardware has it (Ampere or newer), for no scaler, no guessing and no tossed steps.

# %% [markdown]
# ## What to remember
#
# - FSDP = ZeRO-3 organized in units: each unit's parameters are one flat, padded, sharded tensor,
#   gathered just before the unit computes and freed right after. Model states per rank: 16Ψ/N plus the
#   unit(s) in flight; the measured peak parameter bytes matched Σψ/N + ψ_root + k·ψ_block exactly.
# - Per step and unit: all-gather (forward), all-gather again (backward), reduce-scatter (gradients):
#   3Ψ(N-1)/N, 1.5x DDP's bytes, in 3 collectives per unit.
# - Prefetching (forward: the next unit while this one computes; backward: the previous unit's
#   all-gather before this unit's reduce-scatter) hides communication behind compute at the cost of
#   one more unit in memory.
# - Hybrid sharding shards within a host and replicates across hosts: cross-host traffic 2M(W-1)/(GW)
#   instead of 3M(W-1)/W, memory 16Ψ/G instead of 16Ψ/W. It wins while the model fits a host.
# - The wrap policy sets the trade-off between peak memory and the number (and size) of collectives.
# - FSDP shards model states, not activations: checkpointing keeps only each block's input and pays a
#   second forward in backward. fp16 needs a loss scale whose overflow check all ranks agree on; bf16 none.
#
# ## Questions
#
# 1. With `reshard_after_forward=False` a unit stays gathered from its forward until its backward.
#    How many all-gathers per unit per step remain, how many bytes does a step send, and what happens to
#    the peak parameter memory? (Try it: `toolkit.parallel.wrap(model, "fsdp", reshard_after_forward=False)`.)
# 2. Section 5's bound holds two full block gradients at once. Find, in `fsdp.py`'s `_post_backward`, why
#    never three.
# 3. Forward prefetch uses the order of the *previous* forward. What could go wrong for a model whose
#    forward takes a different path through its units every step?
# 4. In the 4-rank run, hybrid sharding was faster than DDP although it sends more bytes in total. Why?
# 5. A 30B-parameter model on hosts of 8 x 80 GB, 64 hosts: full or hybrid sharding? What would
#    sharding over 2 hosts (F = 16) cost across hosts, and save in memory?
