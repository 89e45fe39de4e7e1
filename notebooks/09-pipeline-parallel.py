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
    return bubble.ideal_run(lowering.replay(lowering.lower(actions, pp, tied=True), lowering.unit_cost(split, v)),
                            {"schedule": name, "pp": pp, "microbatches": m})


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
    toolkit.viz.pipeline_timeline(dry_run(name, 4, 8, v), formula=bubble.formula_bubble(name, 4, 8, v),
                                  arrows=name != "interleaved").show()
sends = {name: sum(e["name"] == "send" and e["args"]["message"] in ("activation", "gradient")
                   for e in dry_run(name, 4, 8, v).events) for name, v in (("1f1b", 1), ("interleaved", 2))}
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
idle = {name: lowering.busy_and_span(lowering.replay(lowering.lower(schedules.build(name, 4, 8, v), 4),
                                                     lowering.unit_cost(name == "zb-h1", v)))
        for name, v in (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))}
idle = {name: span - busy[0] for name, (busy, span) in idle.items()}
assert idle == {"1f1b": 9.0, "interleaved": 4.5, "zb-h1": 3.0}  # 3(p-1) units; halved at v = 2; a third for ZB-H1

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
PP_RUNS = {name: launch_train(TrainConfig(strategy="local", steps=3, global_batch_size=8, model=MODEL,
                                          options={"pp": 2, "microbatches": 4, "schedule": name}, progress=False), 2)
           for name in ("1f1b", "zb-h1")}
toolkit.viz.pipeline_timeline(PP_RUNS["1f1b"], formula=bubble.formula_bubble("1f1b", 2, 4)).show()

# %% [markdown]
# On a real machine the stages are not equal (the first holds the embedding, the last the head and the
# loss), actions do not take what the textbook says, and sends and receives take time of their own. So
# the measured bubble differs from the formula. To see which part is the schedule's, replay the run's own
# actions with their **measured** durations and free communication: that is the bubble this schedule
# cannot avoid with these stages; what the real step adds on top of it is the time of the sends, the
# receives and the Python between actions. (The replay is a lower bound: a real rank cannot start an
# action earlier than the replay does.)

# %%
def replayed_span(run, pp, name):
    """The last step replayed with each action's measured duration and free communication (ms)."""
    spans = [e for e in run.events if e["cat"] == "compute" and "action" in e["args"]
             and e["args"]["step"] == run.config["steps"] - 1]
    took = {(e["args"]["action"], e["args"]["micro"], e["args"]["stage"]): e["end"] - e["start"] for e in spans}
    actions = schedules.build(name, pp, 4)
    timeline = lowering.replay(lowering.lower(actions, pp, tied=True), lambda a: took[(a.kind, a.micro, a.stage)])
    real = max(e["end"] for e in spans) - min(e["start"] for e in spans)
    return lowering.busy_and_span(timeline)[1] * 1e3, real * 1e3


for name, run in PP_RUNS.items():
    replayed, real = replayed_span(run, 2, name)
    idle = bubble.measured_bubble(run)
    print(f"{name}: step {real:.1f} ms, replayed with its own action times {replayed:.1f} ms; measured bubble "
          f"{', '.join(f'rank {r} {b:.0%}' for r, b in idle.items())}; formula {bubble.formula_bubble(name, 2, 4):.0%}")
    assert real >= replayed - 1.0  # a real step is never shorter than its replay (clocks agree within 1 ms)

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
        model.driver.observers.append(lambda action: after.append(meter.live))
        with meter:
            model.forward_backward(*SyntheticCorpus().batch(0, 8))
        out[name] = (dist.get_rank(), after[0], meter.peak, meter.live)
    return out


PEAKS = toolkit.launch(activation_peaks, 2)
for rank, found in enumerate(PEAKS):
    for name, (_, one, peak, left) in found.items():
        formula = bubble.formula_in_flight(name, 2, 4, rank)
        print(f"rank {rank} {name:6s}: one micro-batch {one / 1e3:6.1f} kB, peak {peak / 1e3:7.1f} kB = "
              f"{peak / one:.2f} micro-batches (formula {formula}{', counted until W' if name == 'zb-h1' else ''})")
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
#
# Below, one step of each at dp 2 x pp 2 (4 ranks), m = 4: bytes rank 0 sent to its dp peer, measured, over
# ZeRO-1's.

# %%
def dp_bytes(strategies):
    """Bytes rank 0 sent in its data-parallel group during the second of two steps, per strategy."""
    import torch.distributed as dist

    from toolkit.train import train

    out = {}
    for name in strategies:
        run = train(TrainConfig(strategy=name, steps=2, global_batch_size=16, model=MODEL, progress=False,
                                sample_memory=False, options={"pp": 2, "microbatches": 4}))
        first_step_end = next(e["end"] for e in run.events if e["name"] == "optimizer" and e["args"]["step"] == 0)
        out[name] = sum(e["args"]["bytes_sent"] for e in run.events if e["cat"] == "comm" and e["start"] > first_step_end
                        and e["args"]["group"] == DP_GROUP)  # the ranks that hold rank 0's stage
    return out if dist.get_rank() == 0 else None


DP_GROUP = toolkit.parallel.mesh.layout(4, pp=2).group_of(0, "dp")  # [0, 1]: stage 0 on ranks 0 and 1
DP_BYTES = toolkit.launch(dp_bytes, 4, args=(("zero1", "zero2", "zero3", "fsdp"),))[0]
M = 4
for name, expected in (("zero1", 2), ("zero2", M + 1), ("zero3", 3 * M), ("fsdp", 2 * M + 1)):
    ratio = DP_BYTES[name] / DP_BYTES["zero1"] * 2
    print(f"{name}: {DP_BYTES[name] / 1e3:8.1f} kB per step = {ratio:5.2f} x Ψ(N-1)/N  (formula {expected})")
    assert abs(ratio - expected) / expected < 0.01  # flat buffers pad each slice to a multiple of N: < 1%

# %% [markdown]
# The lesson of the table: **under a pipeline, sharding the gradients and the parameters costs m times
# over**. ZeRO-1 talks once per step whatever m is, which is why Megatron-LM pairs pipelines with its
# distributed optimizer (ZeRO-1). ZeRO-3 gathers every module for every micro-batch: with m = 4 it moves
# 6 times ZeRO-1's bytes. torchtitan's FSDP + PP keeps the reduce-scatter to one per step (it runs the
# micro-batches' backwards under `no_sync`, paying the full gradients' memory) but still gathers per
# micro-batch. The same holds with tensor parallelism inside each stage: `wrap(model, "zero1", tp=2, pp=2)`
# on 8 ranks (tests/test_pipeline.py trains it against one process).
#
# **Further.** Checkpoints are layout-free: save at dp 2 x pp 2, load at pp 1 or at tp 2 x pp 2, bit for
# bit (`toolkit.parallel.checkpoint.save_full / load_full`). Bad input is said before training starts: a
# model whose blocks do not split into pp stages (with the split that would work), fewer micro-batches than
# stages for 1F1B, a batch that does not split into micro-batches, an unknown schedule, `pp_split` naming no
# block. Where the toolkit's pipeline departs from Megatron-LM's and torch's (the tied embedding, shapes known
# ahead, the loss on every rank): `docs/differences.md`. Then do `labs/12-pipeline`: write 1F1B's action list,
# graded at pp = 2, 3, 4.
