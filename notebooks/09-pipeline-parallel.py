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
# # 09 · Pipeline parallelism: GPipe, 1F1B, interleaved and zero-bubble schedules, and 3D layouts
#
# Tensor parallelism (lesson 08) splits every layer and talks twice per block. **Pipeline parallelism**
# splits the model the other way: stage 1 holds the first layers, stage 2 the next, ..., and only the
# activations at the cuts cross between ranks, once per *micro-batch*, point to point. The price is time:
# a stage waits for the one before it (forward) and the one after it (backward). Every schedule in the
# literature is a way to fill that wait, the **bubble**, without keeping too many micro-batches'
# activations alive.
#
# The code is `toolkit/parallel/pipeline/`, one idea per file (`schedules.py` first). The plan:
#
# 1. **a schedule is a list of actions per rank**: GPipe, 1F1B, interleaved, ZB-H1, printed;
# 2. **the classic diagram from a dry run**, and the bubble formulas it reproduces exactly;
# 3. **a real pipeline on 2 ranks**: its timeline, its bubble measured against the formula;
# 4. **activation memory per stage**: GPipe holds m micro-batches, 1F1B at most p, measured;
# 5. **3D: data parallelism over the pipeline's replicas**: what ZeRO-1, ZeRO-2, ZeRO-3 and FSDP cost when a
#    step is m micro-batches.
#
# It runs top to bottom in about a minute on a 2-core laptop. Then do `labs/12-pipeline`: you write 1F1B's
# action list.

# %%
import torch

import toolkit
from toolkit.parallel.pipeline import bubble, lowering, schedules
from toolkit.train import TrainConfig, launch_train

MODEL = dict(n_layer=4, d_model=64, n_head=4)  # the tiny GPT, 4 blocks: 2 per stage at pp = 2


def dry_run(name, pp, m, v=1):
    """A schedule's every rank stepped on a clock (a stage's forward 1, backward 2; split: 1 + 1; with v stages
    per rank, each 1/v of that), as a Run."""
    actions = schedules.build(name, pp, m, v)
    split = schedules.splits_backward(actions)
    return bubble.ideal_run(
        lowering.replay(lowering.lower(actions, pp, tied=True), lowering.unit_cost(split, v)),
        {"schedule": name, "pp": pp, "microbatches": m, "virtual_stages": v},
    )


# %% [markdown]
# ## 1. A schedule is data
#
# Cut the model into p stages, the batch into m micro-batches. A rank runs three kinds of action: **F**
# (forward of one micro-batch on its stage), **B** (its backward), and, in zero-bubble schedules, **W**
# (the weights' half of B). A schedule is nothing more than each rank's list of them, printed
# `<stage><kind><micro-batch>`:
#
# - **GPipe** (Huang et al. 2019): every forward, then every backward.
# - **1F1B** (PipeDream-Flush, Narayanan et al. 2021): a warm-up of forwards (how many, on rank r, is lab
#   12's question: read it from the lists below), then one forward, one backward, ..., then the remaining
#   backwards.
#
# Everything else (what to send, when to receive) follows from the list: `lowering.py` puts in a receive
# before each F (the previous stage's activation) and each B (the next stage's gradient), and a send after.

# %%
print("GPipe, p = 4, m = 8\n" + schedules.show(schedules.build("gpipe", 4, 8)))
print("\n1F1B, p = 4, m = 8\n" + schedules.show(schedules.build("1f1b", 4, 8)))
one_f_one_b = schedules.build("1f1b", 4, 8)
assert [a.kind for a in one_f_one_b[0][:5]] == ["F", "F", "F", "F", "B"]  # rank 0: warm-up Fs, then a steady-state F
assert [a.kind for a in one_f_one_b[3][:4]] == ["F", "B", "F", "B"]  # the last stage: no warm-up at all

# %% [markdown]
# ## 2. The classic diagram, and the bubble
#
# Step every rank's program on a clock, a forward costing 1 and a backward 2, a receive waiting for its
# send: that is the diagram of the papers, drawn by the same function that draws real runs below. The
# blank is the bubble. For GPipe and 1F1B alike it is **(p - 1) / (m + p - 1)** of the step: the first
# stage's last backward cannot start before p - 1 stages have run one forward and one backward after its
# first forward. 1F1B does not shrink the bubble; it shrinks the memory (section 4).

# %%
ideal_1f1b = dry_run("1f1b", 4, 8)
toolkit.viz.pipeline_timeline(ideal_1f1b, formula=bubble.formula_bubble("1f1b", 4, 8)).show()

# %% [markdown]
# Two ways to shrink it further:
#
# - **interleaved** (Narayanan et al. 2021, Megatron-LM): each rank holds v stages (rank 0: stages 0 and 4,
#   at v = 2, p = 4), so a micro-batch visits every rank v times and the warm-up is v times shorter:
#   (p - 1) / (v·m + p - 1). The price: more sends, p·v - 1 cuts to cross instead of p - 1.
# - **ZB-H1** (Qi et al. 2024): split backward into B (the input's gradient, which the previous stage waits
#   for) and W (the weights', which nobody waits for), and let the later stages postpone W. The gradients
#   reach the first stage sooner and the postponed W's fill the cool-down: (p - 1)(F + B - W) /
#   (m(F + B + W) + ...), a third of 1F1B's idle time when the three cost the same.

# %%
for name, v in (("gpipe", 1), ("interleaved", 2), ("zb-h1", 1)):
    toolkit.viz.pipeline_timeline(
        dry_run(name, 4, 8, v), formula=bubble.formula_bubble(name, 4, 8, v), arrows=name != "interleaved"
    ).show()
sends = {
    name: sum(
        e["name"] == "send" and e["args"]["message"] in ("activation", "gradient")
        for e in dry_run(name, 4, 8, v).events
    )
    for name, v in (("1f1b", 1), ("interleaved", 2))
}
assert sends == {"1f1b": 2 * 8 * (4 - 1), "interleaved": 2 * 8 * (4 * 2 - 1)}  # m micro-batches x cuts, both ways

# %%
rows = []
for m in (4, 8, 16, 32):
    row = {"m": m}
    for name, v in (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)):
        measured = bubble.measured_bubble(dry_run(name, 4, m, v))[0]
        assert abs(measured - bubble.formula_bubble(name, 4, m, v)) < 1e-12  # the dry run is the formula, exactly
        row[name] = f"{measured:.0%}"
    rows.append(row)
print("bubble at p = 4 (dry run = formula)")
for row in rows:
    print(row)
assert rows[0]["1f1b"] == "43%" and rows[-1]["1f1b"] == "9%"  # m = p ... 8p: the bubble falls as 1/m
idle = {
    name: lowering.busy_and_span(
        lowering.replay(lowering.lower(schedules.build(name, 4, 8, v), 4), lowering.unit_cost(name == "zb-h1", v))
    )
    for name, v in (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))
}
idle = {name: span - busy[0] for name, (busy, span) in idle.items()}
assert idle == {"1f1b": 9.0, "interleaved": 4.5, "zb-h1": 3.0}  # 3(p-1) units; halved at v = 2; a third for ZB-H1

# %% [markdown]
# Interleaving once needed m to be a multiple of p (the micro-batches went through a rank's stages p at a time).
# Megatron-core lifts that: they go in groups of g, g = p when p divides m, else the least g whose last group is
# empty or holds at least p (a smaller last group would leave stages waiting on one another). At p = 4, m = 6 that
# is one group of 6, and the dry run still gives the formula:

# %%
odd = dry_run("interleaved", 4, 6, 2)
toolkit.viz.pipeline_timeline(odd, formula=bubble.formula_bubble("interleaved", 4, 6, 2)).show()
print(
    f"interleaved, p = 4, m = 6, v = 2: groups of {schedules.group_size(4, 6)}; dry run "
    f"{bubble.measured_bubble(odd)[0]:.1%}, formula {bubble.formula_bubble('interleaved', 4, 6, 2):.1%}"
)
assert schedules.group_size(4, 6) == 6 and schedules.group_size(4, 8) == 4
assert abs(bubble.measured_bubble(odd)[0] - bubble.formula_bubble("interleaved", 4, 6, 2)) < 1e-12

# %% [markdown]
# The table's lesson: **the bubble falls as 1/m**, from 43% with m = p = 4 to 9% with m = 32, so pipelines
# want many micro-batches. Per step, 1F1B idles 3(p - 1) units (a forward is 1); interleaving at v = 2 halves
# that, ZB-H1 divides it by three.

# %% [markdown]
# ## 3. A real pipeline
#
# `toolkit.parallel.wrap(model, "local", pp=2, microbatches=4, schedule="1f1b")` cuts the GPT into 2 stages
# (the embedding and blocks 0-1 on rank 0; blocks 2-3, the final norm and the head on rank 1). A step is
# `loss = model.forward_backward(x, y)`: the whole schedule, gradients accumulated over the micro-batches
# (`model(x, y)` is an error: under pp there is no separate forward of the batch). The activations and
# their gradients go through `toolkit.comm` like every collective (send/recv, recorded). The GPT's
# embedding is also its head: the first stage trains it, the last borrows it each step and sends back
# the head's gradient, which the first stage adds to its own: the tied gradient summed across the two
# stages, as Megatron-LM does.
#
# Below: 3 steps of 1F1B and of ZB-H1 on 2 ranks, trained by `toolkit.train`, then the last step's timeline.

# %%
PP_RUNS = {
    name: launch_train(
        TrainConfig(
            strategy="local",
            steps=3,
            global_batch_size=8,
            model=MODEL,
            options={"pp": 2, "microbatches": 4, "schedule": name},
            progress=False,
        ),
        2,
    )
    for name in ("1f1b", "zb-h1")
}
toolkit.viz.pipeline_timeline(PP_RUNS["1f1b"], formula=bubble.formula_bubble("1f1b", 2, 4)).show()

# %% [markdown]
# And the interleaved schedule for real, with a number of micro-batches that pp does not divide: 2 ranks, 2 stages
# each (one block per stage), 3 micro-batches in one group. Each rank runs its actions in the schedule's order:

# %%
ODD = launch_train(
    TrainConfig(
        strategy="local",
        steps=2,
        global_batch_size=6,
        model=MODEL,
        progress=False,
        options={"pp": 2, "microbatches": 3, "schedule": "interleaved", "virtual_stages": 2},
    ),
    2,
)
toolkit.viz.pipeline_timeline(ODD, formula=bubble.formula_bubble("interleaved", 2, 3, 2)).show()
for rank, mine in enumerate(schedules.build("interleaved", 2, 3, 2)):
    ran = sorted(
        (e for e in ODD.events if e["rank"] == rank and "action" in e["args"] and e["args"]["step"] == 1),
        key=lambda e: e["start"],
    )
    assert [(e["args"]["action"], e["args"]["micro"], e["args"]["stage"]) for e in ran] == [tuple(a) for a in mine]

# %% [markdown]
# The measured bubble is far above the formula's. The formula assumes three things a real step does not
# give it: every stage's forward costs the same (F = 1) and its backward twice that (B = 2); sending a message
# costs nothing; a rank does nothing but its actions. Take them away one at a time, measured on the run above:
#
# - **these stages**: replay the step's own programs with each action's *measured* duration and free messages
#   (`bubble.replayed_bubble`). That is the bubble the schedule itself leaves with these stages: the first one
#   also runs the embedding, the last the head and the loss, and a backward is not exactly two forwards.
# - **the real step**: every moment a rank is not in an action is its bubble, and the trace says where it went
#   (`bubble.step_breakdown`): *waiting* for a message (the mailbox's blocked receives), or *between* actions
#   (sending and posting messages, the loss's all-reduce, Python). The two add up to the measured bubble.
#
# Below, side by side, as fractions of the step (the last of the 3):

# %%
import os  # noqa: E402
import statistics  # noqa: E402

M, P = 4, 2
print(f"{'':14s} {'formula':>8s} {'these stages':>13s} {'real':>6s} = {'waiting':>8s} + {'between':>8s}")
for name, run in PP_RUNS.items():
    programs = lowering.lower(schedules.build(name, P, M), P, tied=True)
    formula, replayed = bubble.formula_bubble(name, P, M), bubble.replayed_bubble(run, programs)
    real, parts = bubble.measured_bubble(run), bubble.step_breakdown(run)
    for rank in range(P):
        part = parts[rank]
        print(
            f"{name:6s} rank {rank}: {formula:8.0%} {replayed[rank]:13.0%} {real[rank]:6.0%} = "
            f"{part['waiting']:8.0%} + {part['between']:8.0%}"
        )
        assert abs(real[rank] - (part["waiting"] + part["between"])) < 1e-9  # every idle moment is one or the other
        # the same busy time over the replay's step and the real one: the real step is never shorter than its
        # replay (a real rank cannot start an action earlier than the replay does; the clocks agree to 1 ms)
        spans = [e for e in run.events if e["cat"] == "compute" and "action" in e["args"] and e["args"]["step"] == 2]
        step = max(e["end"] for e in spans) - min(e["start"] for e in spans)
        assert (1 - real[rank]) * step / (1 - replayed[rank]) <= step + 1e-3
    assert any(abs(replayed[r] - formula) > 1e-6 for r in range(P))  # these stages are not the textbook's

# %% [markdown]
# Read the table from the left. The replay's column differs from the formula's because these stages are not
# the textbook's. The real step is never shorter than its replay (a real rank cannot start an action earlier
# than the replay does), and its bubble is exactly the two right columns: time spent waiting for messages and
# time between actions. How long a message takes next to an action is measured below, from the steady steps (each
# message's time from its send to the end of the wait of a receiver that was already waiting for it).

# %%
for name, run in PP_RUNS.items():
    spans = [e for e in run.events if e["cat"] == "compute" and "action" in e["args"] and e["args"]["step"] == 2]
    action = statistics.median(e["end"] - e["start"] for e in spans)
    latency = [t for step in (1, 2) for t in bubble.message_latency(run, step)]  # one step may have no wait
    print(
        f"{name}: an action takes {action * 1e3:.2f} ms (median of {len(spans)}), a message "
        f"{statistics.median(latency) * 1e3:.2f} ms ({len(latency)} measured) and the step sends "
        f"{2 * M * (P - 1) + 2}"
    )
    assert len(spans) == (3 if name == "zb-h1" else 2) * M * P and latency and min(latency) > 0
print(
    f"this machine: {os.cpu_count()} cores for the 2 ranks and their communication threads; load average "
    f"{os.getloadavg()[0]:.1f} while it ran"
)

# %% [markdown]
# So the formula is the bubble of the *schedule*, and a real pipeline adds to it what its stages, its messages and
# its machine cost. Here the two ranks share this machine's cores with gloo's communication threads and with
# whatever else runs (the load average above), so the actions are timed under that sharing, and every message and
# every Python line between actions is paid by a rank that could have computed. The larger a micro-batch's work
# next to a message, the closer the real bubble comes to the replay's; what then remains is the stages' imbalance,
# which Megatron-LM treats by giving the first and the last stage fewer layers.

# %% [markdown]
# ## 4. Activation memory per stage
#
# A stage keeps a micro-batch's activations from its forward until its backward. GPipe runs all m forwards
# first: **m micro-batches** live on every stage. 1F1B starts backward as soon as the pipeline is full:
# rank r holds at most **p - r**, so p on the first stage and 1 on the last, whatever m. (ZB-H1 keeps 1F1B's
# count until B; what W still needs is a part of it.) `ActivationMeter` counts the bytes autograd keeps,
# exactly; below, its peak over one step next to one micro-batch's bytes times the formula.


# %%
def activation_peaks():
    """Per schedule: (bytes after this rank's first forward, the step's peak, bytes left after it)."""
    import torch.distributed as dist

    from toolkit.memory.ledger import ActivationMeter
    from toolkit.models import SyntheticCorpus, tiny_gpt

    out = {}
    for name in ("gpipe", "1f1b", "zb-h1"):
        torch.manual_seed(0)
        model, _ = toolkit.parallel.wrap(tiny_gpt(**MODEL), "local", pp=2, microbatches=4, schedule=name)
        meter, after = ActivationMeter(model), []
        model.driver.observers.append(lambda action, after=after, meter=meter: after.append(meter.live))
        with meter:
            model.forward_backward(*SyntheticCorpus().batch(0, 8))
        out[name] = (dist.get_rank(), after[0], meter.peak, meter.live)
    return out


PEAKS = toolkit.launch(activation_peaks, 2)
for rank, found in enumerate(PEAKS):
    for name, (_, one, peak, left) in found.items():
        formula = bubble.formula_in_flight(name, 2, 4, rank)
        print(
            f"rank {rank} {name:6s}: one micro-batch {one / 1e3:6.1f} kB, peak {peak / 1e3:7.1f} kB = "
            f"{peak / one:.2f} micro-batches (formula {formula}{', counted until W' if name == 'zb-h1' else ''})"
        )
        assert left == 0
        if name != "zb-h1":
            assert peak == formula * one  # exactly: every micro-batch of a stage keeps the same tensors
        else:
            assert peak <= formula * one  # at most p micro-batches until their W, and less: B freed part of them

# %% [markdown]
# GPipe's peak is 4 micro-batches on both ranks; 1F1B's is 2 on the first and 1 on the last, the same bubble
# for half the memory or less. That is why every large-scale trainer (Megatron-LM, DeepSpeed, torchtitan)
# uses 1F1B or one of its descendants.

# %% [markdown]
# ## 5. 3D: data parallelism over pipeline replicas
#
# With tensor and pipeline parallelism a world is laid out as **dp x pp x tp** (a torch `DeviceMesh` named
# ("dp", "pp", "cp", "tp"), in Megatron-LM's rank order: tp fastest so a tensor-parallel group sits inside a
# node, pp slowest so a pipeline's stages are the ranks farthest apart; `order=` picks another). `strategy` is
# the data-parallel method over the dp group, per stage: each stage's replicas
# average their gradients. ZeRO-1 over dp is Megatron-LM's *distributed optimizer*; FSDP over dp is
# torchtitan's FSDP + PP. What changes with micro-batches is **when** a strategy talks:
#
# | strategy | per step, per stage, in units of the stage's Ψ·(N-1)/N bytes |
# |---|---|
# | ZeRO-1 (no_sync for all but the last micro-batch) | reduce-scatter once + all-gather once = **2** |
# | ZeRO-2 (keeps only a slice: reduce-scatters every micro-batch) | m + 1 |
# | ZeRO-3 (gathers each module for every micro-batch's forward and backward) | **3m** |
# | FSDP (no_sync: full gradients kept, reduced once; units gathered per micro-batch) | 2m + 1 |
# | FSDP, `reshard_after_forward=False` (units kept gathered from the first forward to the last backward) | **2** |
#
# Below, one step of each at dp 2 x pp 2 (4 ranks), m = 4: bytes rank 0 sent to its dp peers, measured, over
# ZeRO-1's.


# %%
def dp_bytes(strategies):
    """Bytes rank 0 sent in its data-parallel group during the second of two steps, per strategy; and, for FSDP with
    its units kept gathered or not, the ledger's parameter bytes after each action of that step and the units."""
    import torch.distributed as dist

    from toolkit.comm import group_ranks
    from toolkit.memory import ledger
    from toolkit.models import SyntheticCorpus, tiny_gpt
    from toolkit.parallel import mesh
    from toolkit.train import train

    dp_group = group_ranks(mesh.group(mesh.build(pp=2), "dp"))  # this rank's stage's replicas
    out = {}
    for name, options in strategies.items():
        run = train(
            TrainConfig(
                strategy=name.split(",")[0],
                steps=2,
                global_batch_size=16,
                model=MODEL,
                progress=False,
                sample_memory=False,
                options={"pp": 2, "microbatches": 4, **options},
            )
        )
        first_step_end = next(e["end"] for e in run.events if e["name"] == "optimizer" and e["args"]["step"] == 0)
        out[name] = sum(
            e["args"]["bytes_sent"]
            for e in run.events
            if e["cat"] == "comm" and e["start"] > first_step_end and e["args"]["group"] == dp_group
        )
    for keep in (False, True):
        torch.manual_seed(0)
        model, opt = toolkit.parallel.wrap(
            tiny_gpt(**MODEL), "fsdp", pp=2, microbatches=4, reshard_after_forward=not keep
        )
        batch = SyntheticCorpus().batch(0, 16, rank=model.mesh.get_local_rank("dp"), world_size=2)
        params: list = []
        for step in range(2):
            if step == 1:
                model.driver.observers.append(
                    lambda action, model=model, opt=opt, params=params: params.append(ledger(model, opt)["params"])
                )
            model.forward_backward(*batch)
            opt.step()
            opt.zero_grad()
        units = [u for stage in model.stages.values() for u in stage.describe()]
        out[("memory", keep)] = (params, sum(u["shard_numel"] for u in units), sum(u["padded_numel"] for u in units))
    return out if dist.get_rank() == 0 else None


STRATEGIES = {
    "zero1": {},
    "zero2": {},
    "zero3": {},
    "fsdp": {},
    "fsdp, kept gathered": {"reshard_after_forward": False},
}
DP_BYTES = toolkit.launch(dp_bytes, 4, args=(STRATEGIES,))[0]
MICRO = 4  # dp_bytes's micro-batches
FORMULA = {"zero1": 2, "zero2": MICRO + 1, "zero3": 3 * MICRO, "fsdp": 2 * MICRO + 1, "fsdp, kept gathered": 2}
for name, expected in FORMULA.items():
    ratio = DP_BYTES[name] / DP_BYTES["zero1"] * 2
    print(f"{name:20s}: {DP_BYTES[name] / 1e3:8.1f} kB per step = {ratio:5.2f} x Ψ(N-1)/N  (formula {expected})")
    assert abs(ratio - expected) / expected < 0.01  # flat buffers pad each slice to a multiple of N: < 1%

# %% [markdown]
# The lesson of the table: **under a pipeline, sharding the gradients and the parameters costs m times
# over**. ZeRO-1 talks once per step whatever m is, which is why Megatron-LM pairs pipelines with its
# distributed optimizer (ZeRO-1). ZeRO-3 gathers every module for every micro-batch: with m = 4 it moves
# 6 times ZeRO-1's bytes. FSDP keeps the reduce-scatter to one per step (it runs the micro-batches' backwards
# under `no_sync`, paying the full gradients' memory) but by default still gathers twice per micro-batch.
# torchtitan's default under pp is the last row: `reshard_after_forward=False`, and torch's pipeline stage tells
# FSDP2 not to free the units after any backward but the last, so each unit is gathered once per step and FSDP
# moves what ZeRO-1 moves. The price is memory: the stage's parameters are held whole for the whole step. The
# ledger, sampled after every action of rank 0's step, against that formula (the fp32 shards, plus every unit's
# whole fp32 buffer while it is kept):

# %%
for keep in (False, True):
    params, shard_numel, padded_numel = DP_BYTES[("memory", keep)]
    formula = 4 * shard_numel + (4 * padded_numel if keep else 0)
    print(
        f"fsdp{', kept gathered' if keep else '':15s}: parameter bytes after each action "
        f"{sorted(set(params))} (formula between actions {formula:,}: shards {4 * shard_numel:,}"
        f"{f' + whole units {4 * padded_numel:,}' if keep else ''})"
    )
    assert params[:-1] == [formula] * (len(params) - 1)  # every action but the last: exactly the formula
    assert params[-1] == 4 * shard_numel  # the last backward frees the units either way

# %% [markdown]
# Rank 0's stage holds the embedding and the first two blocks: kept gathered, its parameters take the whole
# stage's bytes on top of the shards from the first forward to the last backward, where by default they take
# the shards alone between actions. Which to choose is the classic trade: one all-gather of the stage per step and
# ZeRO-2-like parameter memory, or 2m all-gathers and ZeRO-3's. The same holds with tensor parallelism inside each
# stage: `wrap(model, "zero1", tp=2, pp=2)` on 8 ranks (tests/test_pipeline.py trains it against one process).
#
# **Further.** Checkpoints are layout-free: save at dp 2 x pp 2, load at pp 1 or at tp 2 x pp 2, bit for
# bit (`toolkit.parallel.checkpoint.save_full / load_full`). Bad input is said before training starts: a
# model whose blocks do not split into pp stages (with the split that would work), fewer micro-batches than
# stages for 1F1B, a batch that does not split into micro-batches, an unknown schedule, `pp_split` naming no
# block. Where the toolkit's pipeline departs from Megatron-LM's and torch's (the tied embedding, shapes known
# ahead, the loss on every rank): `docs/differences.md`. Then do `labs/12-pipeline`: write 1F1B's action list,
# graded at pp = 2, 3, 4.
