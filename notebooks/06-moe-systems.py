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
# # 06 · MoE systems: shadowing, smart schedule, pipelining, topology-aware gate
#
# Notebook 05 built the expert-parallel MoE layer and ended on its weak spots: the rank that holds the
# popular experts is the straggler, nothing computes while rows travel, and every row may cross the
# slowest link. FasterMoE (PPoPP'22) names three challenges and answers each; Tutel adds an adaptive
# pipeline. All of them are options of `toolkit.moe.MoE`, and none changes what the layer computes
# (the tests compare outputs and gradients with the plain path to 1e-5):
#
# | challenge | what you see | the fix | option |
# | --- | --- | --- | --- |
# | 1. **imbalance** | one rank computes most rows, the others wait inside the all-to-all | shadow the hot experts: their weights travel, their rows stay home (FasterMoE) | `shadow="auto"` |
# | 2. **coarse operators** | dispatch, experts, combine run one after the other: the link idles while the experts compute, and the other way round | cut the work and overlap the pieces: per-peer steps (FasterMoE's smart schedule) or chunks along the capacity (Tutel) | `schedule="smart"`, `pipeline_degree=d` |
# | 3. **congested links** | rows cross the slow link between nodes | limit what leaves a node, re-route the rest inside it (FasterMoE's topology-aware gate) | `gate="topology"` |
#
# Each fix is switched on in turn on real ranks, and three pictures are redrawn: the **timeline** (who
# computes and who talks, when), the **expert load** (which experts got the tokens, which were
# shadowed) and the **DDL-roofline** (FasterMoE's picture of where a layer stands between computing
# and communicating).
#
# **The link is emulated, on purpose.** On this laptop the ranks share two cores and talk over
# loopback: communicating costs almost nothing next to computing, which no GPU cluster resembles, and
# every one of these systems is about that balance. `toolkit.comm.emulate(bandwidth=..., latency=...)`
# makes every collective take at least as long as a link with those parameters would; the data still
# moves for real. We pick the link by measuring first: the plain layer runs once on loopback, and the
# bandwidth is set so that its all-to-alls take as long as its experts compute (R_CC = 1). By
# FasterMoE's model, that is roughly where their MoE-GPT-S sits on V100s with 100 Gb/s InfiniBand.
# Every number printed below says which link it was measured on.
#
# It runs top to bottom in well under a minute on a 2-core laptop (two launches: 2 ranks, then 4).
# Then do `labs/05-shadowing`: you write the rule that decides which experts to shadow. What each
# system here does differently from FasterMoE's and Tutel's releases: `docs/differences.md`.

# %%
import re
import statistics

import toolkit
from toolkit import viz
from toolkit.moe import choose_shadows
from toolkit.run import Run

WORLD = 2
D, FF, PER_RANK, K = 128, 256, 2, 2  # d_model, d_ff (alpha = 2, as FasterMoE's models), experts per rank, top-k
TOKENS = 1024  # tokens per rank per iteration
ZIPF = 1.5  # skew: expert e's logit prior is -ZIPF * ln(rank of e + 1)
ITERATIONS = 8  # per configuration; the first warms up
LATENCY_S = 0.5e-3  # per message on the emulated link


# %% [markdown]
# ## 0. One layer, skewed routing, a link like a GPU cluster's
#
# One MoE layer, E = 4 experts (2 per rank), d_model 128, d_ff 256, top-2, dropless (FasterMoE keeps
# every choice), 1024 tokens per rank. The routing is Zipf-skewed: every token's logit for expert e carries a prior
# -1.5·ln(p(e) + 1), where p(e) is e's place in a popularity order, plus per-token noise. The
# popularity order **drifts**: it rotates by one expert every two iterations, as FasterMoE observed
# real routers do. So the hottest expert is 0, then 1 (both on rank 0), then 2, then 3 (on rank 1).
#
# Everything for 2 ranks happens in one launch: calibrate the link on loopback, then every
# configuration, each for 8 iterations (forward + backward), each with its own trace.


# %%
def popularity(iteration, experts):
    """The popularity order at this iteration: rotated by one expert every two iterations."""
    shift = iteration // 2
    return [(e + shift) % experts for e in range(experts)]


def set_routing(layer, iteration, zipf):
    """Router: feature 0 (always 1) carries the Zipf prior in this iteration's popularity order."""
    import torch

    E, d = layer.num_experts, layer.d_model
    with torch.no_grad():
        if iteration == 0:
            noise = torch.randn(E, d, generator=torch.Generator().manual_seed(0)) / (d - 1) ** 0.5
            layer.gate.router.weight.copy_(noise)
        place = torch.empty(E)
        place[popularity(iteration, E)] = torch.arange(E, dtype=torch.float32)
        layer.gate.router.weight[:, 0] = -zipf * torch.log(place + 1)


def batch(iteration, tokens, d, rank):
    import torch

    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(100 * iteration + rank))
    x[:, 0] = 1.0
    return x.requires_grad_(True)


def run_config(label, options, iterations, tokens=TOKENS, per_rank=PER_RANK, zipf=ZIPF):
    """One configuration on this rank: `iterations` forward + backward passes, each timed (the slowest
    rank's time) and traced. Returns (this rank's Run, step times). Collective: every rank calls it."""
    import time
    import warnings

    import torch
    import torch.distributed as dist

    from toolkit.moe import MoE
    from toolkit.run import Run

    warnings.filterwarnings("ignore", message=".*does not divide the occupied capacity.*")  # padding: see section 2
    from toolkit.trace import recorder, span

    rank, world = dist.get_rank(), dist.get_world_size()
    options = dict(options)
    capacity_factor = options.pop("capacity_factor", 1.25)
    dropless = options.pop("dropless", True)
    layer = MoE(
        D,
        FF,
        int(per_rank * world),
        top_k=K,
        capacity_factor=capacity_factor,
        dropless=dropless,
        seed=0,
        init_std=0.05,
        name="moe",
        **options,
    )
    recorder.reset()
    times = []
    for i in range(iterations):
        set_routing(layer, i, zipf)
        x = batch(i, tokens, D, rank)
        layer.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        with span("forward", step=i):
            out, aux = layer(x)
        with span("backward", step=i):
            (out.square().mean() + 0.01 * aux).backward()
        seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # raw: bookkeeping, not part of the trace
        times.append(seconds.item())
    return Run.capture({"label": label}), times


# %% [markdown]
# Calibration, in words: on loopback, the slowest rank's experts compute for `comp` seconds in one
# forward (backward costs about twice that: FasterMoE's model counts 3x), and its dispatch and combine
# move `B` bytes (the larger of what it sends and what it receives, per all-to-all; backward moves
# them again). The emulated link's model for one all-to-all is latency + bytes / bandwidth, so
# R_CC = 1 asks for bandwidth = 2B / (3 comp - 4 latency).

# %%
CONFIGS = {  # label -> MoE options
    "plain": {},
    "shadow auto": dict(shadow="auto"),
    "smart schedule": dict(schedule="smart"),
    "pipeline 2": dict(pipeline_degree=2),
    "pipeline 4": dict(pipeline_degree=4),
    "pipeline 8": dict(pipeline_degree=8),
}
SWEEP_FACTORS, SWEEP_DEGREES = (0.5, 1.0, 2.0), (1, 2, 4, 8)


def calibrate(run):
    """(expert compute seconds, bytes on the link) of one forward of the plain layer, this rank's view,
    median over the iterations after the first."""
    per_pass = []
    for i in range(1, ITERATIONS):
        forward = [e for e in run.events if e["name"] == "forward" and e["args"].get("step") == i][0]
        inside = [e for e in run.events if forward["start"] <= e["start"] <= forward["end"]]
        comp = sum(e["end"] - e["start"] for e in inside if e["name"] == "moe/moe/experts")
        wire = sum(
            max(e["args"]["bytes_sent"], e["args"]["bytes_recv"])
            for e in inside
            if e["args"].get("moe") in ("dispatch", "combine")
        )
        per_pass.append((comp, wire))
    return [statistics.median(c for c, _ in per_pass), statistics.median(w for _, w in per_pass)]


def everything_on_two_ranks():
    import torch
    import torch.distributed as dist

    import toolkit

    run_config("warm-up", {}, 2)  # first touches: not measured
    results = {"plain, loopback": run_config("plain, loopback", {}, ITERATIONS)}
    mine = torch.tensor(calibrate(results["plain, loopback"][0]), dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the slowest rank's compute and bytes
    comp, wire = mine.tolist()
    bandwidth = 2 * wire / (3 * comp - 4 * LATENCY_S)
    with toolkit.comm.emulate(bandwidth=bandwidth, latency=LATENCY_S):
        for label, options in CONFIGS.items():
            results[label] = run_config(label, options, ITERATIONS)
        for f in SWEEP_FACTORS:  # Tutel: degree against capacity factor
            for d in SWEEP_DEGREES:
                options = dict(pipeline_degree=d, capacity_factor=f, dropless=False)
                results[f"f={f:g} d={d}"] = run_config(f"f={f:g}, d={d}", options, 3, zipf=0.5)
    return results, {"comp_s": comp, "wire_bytes": wire, "bandwidth": bandwidth}


per_rank = toolkit.launch(everything_on_two_ranks, WORLD)
runs = {label: Run.merge(r[0][label][0] for r in per_rank) for label in per_rank[0][0]}
times = {label: per_rank[0][0][label][1] for label in per_rank[0][0]}
link = per_rank[0][1]
print(
    f"loopback, plain layer: the slowest rank's experts compute {link['comp_s'] * 1e3:.1f} ms per forward; "
    f"its dispatch + combine move {link['wire_bytes'] / 1e3:.0f} kB"
)
print(f"emulated link for R_CC = 1: {link['bandwidth'] / 1e6:.1f} MB/s, {LATENCY_S * 1e3:g} ms per message")
print(f"(same trace, as recorded: {runs['plain'].meta['emulated_link']['description']})")


# %%
def step_ms(label):
    """Median step time (forward + backward, the slowest rank) over the iterations after the first."""
    return statistics.median(times[label][1:]) * 1e3


def labelled(run):
    """A copy of the Run whose collectives are named after their role (dispatch, combine, shadow ...);
    chunk and step numbers are folded together so a pipeline's chunks share one colour."""

    def name(e):
        role = e["args"].get("moe")
        if not role or e["cat"] != "comm":
            return e["name"]
        role = re.sub(r" (chunk|step) [0-9]+/[0-9]+", r" \1s", re.sub(r"expert [0-9]+", "expert", role))
        return f"{e['name']} · {role}"

    return Run(run.config, [dict(e, name=name(e)) for e in run.events], run.samples, run.metrics, run.meta)


def for_roofline(run):
    """The roofline counts expert work from the "moe/<layer>/experts" spans; shadowed experts computed at
    home have their own span ("moe/<layer>/shadowed experts"), counted here as expert work too."""
    rename = {"moe/moe/shadowed experts": "moe/moe/experts"}
    return Run(
        run.config,
        [dict(e, name=rename.get(e["name"], e["name"])) for e in run.events],
        run.samples,
        run.metrics,
        run.meta,
    )


def iteration(run, label, i=None):
    """Timeline of iteration i (default: the last) of a configuration, forward and backward, every rank."""
    starts = sorted(e["start"] for e in run.events if e["name"] == "forward" and e["rank"] == 0)
    i = len(starts) - 1 if i is None else i
    begin, end = starts[i] - 2e-3, starts[i + 1] - 2e-3 if i + 1 < len(starts) else float("inf")
    return viz.timeline(
        labelled(run),
        where=lambda e: begin <= e["start"] < end and e["name"] not in ("forward", "backward"),
        title=f"{label}: iteration {i}, forward then backward ({times[label][i] * 1e3:.0f} ms; "
        f"median step {step_ms(label):.0f} ms)",
    )


SHOW = 1  # the iteration the timelines of section 1 show: experts 0 and 1, the hottest, both on rank 0

print(f"{'configuration':<18}{'step (ms)':>10}")
for label in ["plain, loopback"] + list(CONFIGS):
    print(f"{label:<18}{step_ms(label):>10.0f}")

# %% [markdown]
# ## 1. Challenge 1: imbalance
#
# The plain layer on the emulated link. Read the timeline per rank: the top lane is communication,
# the lower one computation (grey boxes: experts; "wait": the rank is held by the emulated link or by
# its peer). Iteration 1: the two hottest experts, 0 and 1, both live on rank 0, whose expert boxes
# are the long ones; rank 1 finishes early and waits inside the combine all-to-all (its span
# stretches) until rank 0 is done. The plain layer's expert backward runs inside autograd without a
# span of its own: it is the gap between "combine backward" and "dispatch backward".

# %%
iteration(runs["plain"], "plain", SHOW)

# %% [markdown]
# The load over the 8 iterations: red is busier than a balanced expert, blue idler; the black dot
# marks the busiest expert, which moves as the popularity order drifts (0, 1, 2, then 3).

# %%
viz.expert_load(runs["plain"], title="plain layer: expert load per iteration (drifting Zipf skew)")

# %% [markdown]
# ### The fix: shadowing, and why the predictor chose what it chose
#
# Shadowing an expert broadcasts its weights from its owner to every rank; each rank computes its own
# rows for it at home, and backward returns the weight gradients to the owner. Before every forward,
# FasterMoE's predictor weighs, for the counts this forward has just exchanged, the latency of the
# plain layer against the latency with some experts shadowed (the compute rate P measured here, the
# bandwidth W_net taken from the emulated link), and Algorithm 1 adds experts heaviest first while
# the prediction falls. Here is its reasoning on iteration 1's counts, recomputed from the Run's
# records with `toolkit.moe.choose_shadows` (the layer's own decision is printed under it):

# %%
shadow_records = [v for _, v in runs["shadow auto"].metric("moe/moe/shadow", rank=0)]
last = shadow_records[SHOW]
table = [
    v["kept"]
    for _, v in sorted(
        (m["rank"], m["value"])
        for m in runs["shadow auto"].metrics
        if m["name"] == "moe/moe/load" and m["value"]["call"] == SHOW + 1
    )
]
owners = [e // PER_RANK for e in range(PER_RANK * WORLD)]
choice = choose_shadows(table, owners, H=D, alpha=FF / D, P=last["compute_flops"], W_net=last["bandwidth"])
print(
    f"counts (rows per rank per expert): {table};  P = {last['compute_flops'] / 1e9:.1f} GFLOP/s "
    f"({last['source']['compute_flops']}), W_net = {last['bandwidth'] / 1e6:.1f} MB/s ({last['source']['bandwidth']})\n"
)
print(choice.explain())
print(f"\nthe layer shadowed {last['shadowed']}; per iteration: {[r['shadowed'] for r in shadow_records]}")
print(
    f"predicted {last['predicted_s'] * 1e3:.0f} ms (plain {last['plain_s'] * 1e3:.0f} ms), "
    f"measured {last['measured_s'] * 1e3:.0f} ms for steps 2-6 of this forward and backward"
)

# %% [markdown]
# The model is deliberately simple: a row costs 3·4·α·H² FLOPs and 4·H elements on the wire, a
# shadowed expert 2·α·H² elements moved twice. And it forgets something: it charges the plain layer
# for every row on the wire (even rows a rank keeps for its own experts) and the shadowed layer for
# none of the rows that still travel. So it is optimistic: compare its predicted time with the
# measured one. Its job is to rank the options (shadow this expert, or not) well enough, not to
# predict the step; the measured-against-predicted record (`moe/<layer>/shadow` in the Run, every
# forward) is there to check how well it does.
#
# The shadowed layer, on the same link and the same batches: the weights' broadcast (and, in
# backward, the gradients' all-reduce back to the owner) appear on the timeline; the hot expert's
# rows no longer travel, so the dispatch and combine shrink, and both ranks now compute.

# %%
iteration(runs["shadow auto"], "shadow auto", SHOW)

# %% [markdown]
# The load heatmap marks each shadowed expert with a green square: it follows the hot expert as it
# drifts. (The colours are the routing's, unchanged: shadowing moves where the rows are computed,
# not where the router sends them.)

# %%
viz.expert_load(runs["shadow auto"], title="shadow='auto': the same load, shadowed experts marked")

# %%
for label in ("plain", "shadow auto"):
    print(f"{label:<12} step per iteration (ms): {[round(t * 1e3) for t in times[label]]}")
print(f"shadowing: {step_ms('plain') / step_ms('shadow auto'):.2f}x over plain on this link (median step)")

# %% [markdown]
# Whatever this run measured, read where the time went on the two timelines. Shadowing removes the
# hot expert's rows from every all-to-all (the link's model time of dispatch and combine drops) and
# takes work off the busiest rank. It pays with the weights' broadcast and, in backward, the
# gradients' all-reduce. Both are posted where computation can hide them, as FasterMoE does with
# separate CUDA streams (`toolkit/moe/shadow_steps.py` lists the order): on the timeline the broadcast
# travels under the local experts' box, the shadowed expert computes while the combine travels, and
# the all-reduce travels under the local experts' backward. What stays exposed is the dispatch before
# the first computation and the dispatch's backward after the last. On this small layer (1024 tokens
# per rank, d_ff = 256) the whole margin is a few milliseconds out of a step of tens, about the size
# of this shared machine's noise; a bigger batch keeps more rows at home for each weight moved.
# `bench/moe_systems.py` measures shadowing on a larger layer and
# on a slower link, where the rows saved outweigh the weights by far (`docs/benchmarks.md`).

# %% [markdown]
# ### The DDL-roofline
#
# FasterMoE places a layer on a plane: x is R_CC = Lat_comp / Lat_comm (how long the experts compute
# against how long the all-to-alls take), y the expert FLOPs each rank gets done per second of the
# layer's time. A rank computing at P FLOP/s can at best reach P·min(1, R_CC) (communication fully
# hidden, the "ideal" line) and, doing one after the other, P·R_CC/(R_CC + 1) (the "semi-ideal" line).
# The plain layer sits on or below the semi-ideal line (imbalance pulls it down: ranks wait for the
# busiest one). Shadowing should move the point right (fewer rows to communicate, although weights now
# travel) and up (the busiest rank computes less). Hover over a point for its latencies.

# %%
viz.roofline(
    {label: for_roofline(runs[label]) for label in ("plain", "shadow auto", "plain, loopback")},
    d_model=D,
    d_ff=FF,
    skip=1,
    title="DDL-roofline: the plain layer and shadowing (forward passes)",
)

# %% [markdown]
# On loopback the layer sits far right (communication is nearly free), which is why the comparisons
# use the emulated link.
#
# ## 2. Challenge 2: coarse operators
#
# Dispatch, experts, combine: three big operators, each waiting for the one before. Two ways to cut
# them so that the link and the experts work at the same time.
#
# **FasterMoE's smart schedule** cuts along the peers. With W ranks, at step j rank i sends its rows
# for rank (i - j) mod W and receives rank (i + j) mod W's rows for its experts; as soon as a block
# has landed the experts compute it while the next block travels, and its outputs go back at once.
# Step 0 is the block a rank keeps for itself, so it computes while the first real transfer is in
# flight. On the timeline: sends and receives labelled "dispatch steps" and "combine steps" (point-to-
# point, per peer), expert boxes in between. The paper's unit is a group of workers rather than one:
# `smart_group_size=g` makes W/g steps, each exchanging a block with every rank of one group (fewer,
# larger steps; `docs/benchmarks.md` measures when that pays).

# %%
iteration(runs["smart schedule"], "smart schedule")

# %% [markdown]
# **Tutel's pipelining** cuts along the capacity: the rows bound for each expert are split into d
# chunks of slots, and chunk i+1's all-to-all travels while chunk i's experts compute. Small d
# overlaps little; large d pays per chunk (a message's latency, smaller matrix products, Python
# overhead here). Degree 4:

# %%
iteration(runs["pipeline 4"], "pipeline 4")

# %% [markdown]
# How much can overlap give at most? If Lat_comm and Lat_comp could be hidden behind each other
# completely, a layer that did them one after the other would speed up by
# (Lat_comm + Lat_comp) / max(Lat_comm, Lat_comp), the **ideal speedup** FasterMoE quotes. From the
# plain layer's trace (forward passes, the slowest rank; on the emulated link Lat_comm is the link's
# model time). Then, for every configuration, the same latencies of steps 4-6 (Lat_e2e: from the
# first transfer to the last; the plain layer's is at least Lat_comm + Lat_comp, plus the time its
# ranks wait for the busiest one; a perfect overlap would bring it down to max(Lat_comm, Lat_comp)),
# and the step time (forward + backward, gate and all).

# %%
plain_point = viz.roofline_point(runs["plain"], D, FF, skip=1)
ideal = (plain_point["lat_comm"] + plain_point["lat_comp"]) / max(plain_point["lat_comm"], plain_point["lat_comp"])
print(
    f"plain layer: Lat_comp {plain_point['lat_comp'] * 1e3:.1f} ms, Lat_comm {plain_point['lat_comm'] * 1e3:.1f} ms "
    f"per forward (R_CC {plain_point['r_cc']:.2f}): ideal speedup of overlapping {ideal:.2f}x\n"
)
print("steps 4-6 per forward, the slowest rank, median over iterations (from each configuration's trace), in ms:")
print(f"{'configuration':<16}{'Lat_comm':>10}{'Lat_comp':>10}{'Lat_e2e':>9}{'step':>8}{'vs plain':>10}")
for label in CONFIGS:
    p = viz.roofline_point(for_roofline(runs[label]), D, FF, skip=1)
    print(
        f"{label:<16}{p['lat_comm'] * 1e3:>10.1f}{p['lat_comp'] * 1e3:>10.1f}{p['lat_e2e'] * 1e3:>9.1f}"
        f"{step_ms(label):>8.0f}{step_ms('plain') / step_ms(label):>9.2f}x"
    )

# %% [markdown]
# Read the gap between the ideal and what was measured. Three reasons, all visible on the timelines:
#
# - On 2 ranks the smart schedule has a single real step: only the block a rank keeps for itself can
#   overlap the one transfer, and the outputs of the last block travel with nothing left to compute.
#   With W ranks there are W - 1 transfers to hide; FasterMoE's gains grow with the cluster.
# - Chunks cost: each one pays a message's latency, a smaller matrix product and, here, Python
#   overhead of a few hundred microseconds, which a GPU would not have. Degree 8 pays it 32 times.
# - The imbalance is still there: overlap hides the link behind the busiest rank's long expert boxes,
#   but that rank still computes most rows. Shadowing and overlap are complementary (FasterMoE uses
#   both).
#
# And the machine: these ranks share two cores with whatever else runs, so a step's compute moves by
# tens of percent from one iteration to the next (compare the per-iteration times in section 1). The
# link times (Lat_comm) are the emulated model's and do not move; the compute times do.
#
# The roofline with everything so far: overlap moves a point up, toward the ideal line, at the same
# R_CC; shadowing moves it right.

# %%
viz.roofline(
    {label: for_roofline(runs[label]) for label in CONFIGS},
    d_model=D,
    d_ff=FF,
    skip=1,
    title="DDL-roofline: every configuration of the 2-rank layer (emulated link)",
)

# %% [markdown]
# ### Pipelining degree against capacity factor
#
# Tutel's observation: the best degree depends on the workload, which changes every iteration, so it
# is chosen at run time (`pipeline_degree="auto"` tries 1, 2, 4, 8 per capacity bucket and keeps the
# fastest). A small sweep on the same link: capacity factor f (the layer now drops what exceeds
# C = ceil(k·f·T/E); milder skew, Zipf 0.5, so that f matters) against degree d. A larger f keeps more
# rows, so more to move and compute, and more to cut. In this layer only kept rows travel, so once f
# keeps every row a larger f changes nothing; Tutel's buffers are padded to C, so there the work keeps
# growing with f. A degree that does not divide the occupied capacity is padded (the last chunk is
# partly empty; nothing extra travels).

# %%
print("step time (ms), median of the 2 iterations after a warm-up; rows: capacity factor, columns: degree")
print(f"{'f':>5}" + "".join(f"{'d=' + str(d):>9}" for d in SWEEP_DEGREES) + f"{'best':>8}{'rows kept':>11}")
for f in SWEEP_FACTORS:
    row = {d: statistics.median(times[f"f={f:g} d={d}"][1:]) * 1e3 for d in SWEEP_DEGREES}
    kept = sum(
        sum(m["value"]["kept"])
        for m in runs[f"f={f:g} d=1"].metrics
        if m["name"] == "moe/moe/load" and m["value"]["call"] == 3
    )
    print(
        f"{f:>5g}" + "".join(f"{row[d]:>9.0f}" for d in SWEEP_DEGREES) + f"{'d=' + str(min(row, key=row.get)):>8}"
        f"{kept:>11}"
    )

# %% [markdown]
# On a shared 2-core machine these numbers move by tens of percent between runs; read the shape, not
# the last digit. The lesson Tutel draws is the shape: no single degree wins everywhere, which is why
# the degree is searched at run time and remembered per capacity bucket.
#
# ## 3. Challenge 3: congested links
#
# A cluster's links are not equal: inside a node GPUs talk over fast local links, between nodes over a
# slower network. Now 4 ranks in 2 emulated nodes of 2 (256 tokens per rank, 8 experts): the link
# inside a node is the one calibrated above, the link between nodes 4 times slower (a congested
# network). Experts 0-3 live on node 0 (ranks 0, 1), experts 4-7 on node 1, and the Zipf skew makes
# node 0's experts the popular ones, so node 1's rows want to leave their node.
#
# FasterMoE's topology-aware gate lets at most L = W_net / (M · W_local) · B of a worker's B rows leave
# its node (M workers per node), highest scores first; the others re-pick among the experts inside the
# node. Unlike the other fixes, this one changes the routing (by design): it trades a little model
# freedom for traffic on the slow link. The gate reads M, W_net and W_local from the emulated link.
#
# The congestion itself is in the link: the two ranks of a node share its card to the network, so
# when both send across at once their bytes queue (`toolkit.comm.emulate`'s "The node's card is
# shared"). Each gate runs twice: with that shared card, and with a card per rank (`shared_card=False`,
# the same network without congestion). Everything for 4 ranks happens in this one launch, section 4's
# Tutel configurations too (4 iterations each for the gates, 3 for the others).

# %%
FOUR = {  # label -> (MoE options, experts per rank, the node's card shared, iterations)
    "top-k gate": ({}, PER_RANK, True, 4),
    "topology gate": (dict(gate="topology"), PER_RANK, True, 4),
    "top-k gate, own cards": ({}, PER_RANK, False, 4),
    "topology gate, own cards": (dict(gate="topology"), PER_RANK, False, 4),
    "2DH all-to-all": (dict(all_to_all_algorithm="2dh"), PER_RANK, True, 3),  # section 4
    "EP+MP, r=2": ({}, 0.5, True, 3),  # 2 experts on 4 ranks
    "EP+DP, r=1": (dict(expert_slices=1), 0.5, True, 3),
    "DP": (dict(expert_parallel="dp"), 0.5, True, 3),
    "static f=1": (dict(capacity_factor=1.0, dropless=False, zipf=0.5), PER_RANK, True, 3),
    "static f=4": (dict(capacity_factor=4.0, dropless=False, zipf=0.5), PER_RANK, True, 3),
    "dynamic f<=4": (dict(capacity_factor=4.0, dropless=False, dynamic_capacity=True, zipf=0.5), PER_RANK, True, 3),
}


def everything_on_four_ranks(bandwidth):
    import toolkit

    out = {}
    for label, (options, per_rank, shared, iterations) in FOUR.items():
        options = dict(options)
        zipf = options.pop("zipf", ZIPF)
        with toolkit.comm.emulate(
            bandwidth=bandwidth / 4,
            latency=LATENCY_S,
            intra_node=dict(bandwidth=bandwidth),
            ranks_per_node=2,
            shared_card=shared,
        ):
            out[label] = run_config(label, options, iterations, tokens=256, per_rank=per_rank, zipf=zipf)
    return out


four = toolkit.launch(everything_on_four_ranks, 4, args=(link["bandwidth"],))
for label in FOUR:
    runs[label] = Run.merge(r[label][0] for r in four)
    times[label] = four[0][label][1]
for label in ("top-k gate", "topology gate"):
    print(f"{label:<14} step per iteration (ms): {[round(t * 1e3) for t in times[label]]}")
print(runs["topology gate"].meta["emulated_link"]["description"])

# %% [markdown]
# The gate's own record (`moe/<layer>/topology`, per rank and iteration): rows that wanted to leave the
# node, the limit L, rows sent, rows re-routed inside. And, for both gates, the rows that actually
# crossed between nodes (from the load records: rows routed to experts on the other node).


# %%
def crossing(run, rank, iteration):
    """Rows this rank sent to experts on the other node in this iteration (from its load record)."""
    load = [m["value"] for m in run.metrics if m["name"] == "moe/moe/load" and m["rank"] == rank][iteration]
    node_of_expert = [e // (2 * PER_RANK) for e in range(len(load["kept"]))]
    return sum(c for e, c in enumerate(load["kept"]) if node_of_expert[e] != rank // 2)


last_it = 3
print(f"iteration {last_it}:")
print(
    f"{'rank':>4}{'node':>5}{'wanted out':>12}{'limit L':>9}{'sent':>6}{'re-routed':>11}"
    f"{'crossed, top-k':>16}{'crossed, topology':>19}"
)
for rank in range(4):
    rec = [v for _, v in runs["topology gate"].metric("moe/moe/topology", rank=rank)][last_it]
    print(
        f"{rank:>4}{rec['node']:>5}{rec['wanted']:>12}{rec['limit']:>9}{rec['sent']:>6}{rec['redirected']:>11}"
        f"{crossing(runs['top-k gate'], rank, last_it):>16}{crossing(runs['topology gate'], rank, last_it):>19}"
    )
print(
    f"\nstep time: top-k {step_ms('top-k gate'):.0f} ms, topology-aware {step_ms('topology gate'):.0f} ms "
    f"({step_ms('top-k gate') / step_ms('topology gate'):.2f}x)"
)

# %% [markdown]
# The load, gate by gate: with the topology-aware gate the experts of node 1 (4-7) get the rows that
# node 1's ranks were not allowed to send out, so the load spreads over both nodes.

# %%
viz.expert_load(runs["top-k gate"], title="4 ranks, top-k gate: expert load per iteration")

# %%
viz.expert_load(runs["topology gate"], title="4 ranks, topology-aware gate: the same tokens, routed under the limit")

# %%
iteration(runs["topology gate"], "topology gate")

# %%
viz.roofline(
    {"top-k gate": runs["top-k gate"], "topology gate": runs["topology gate"]},
    d_model=D,
    d_ff=FF,
    skip=1,
    title="DDL-roofline, 4 ranks in 2 nodes: top-k against topology-aware gate",
)

# %% [markdown]
# Node 1's ranks wanted to send most of their rows to node 0's popular experts; the gate let L of them
# go and re-routed the rest to experts in their own node. Node 0's ranks find their favourite experts
# at home and wanted few rows out, close to the limit. Less crosses the slow link, so the all-to-alls
# shorten. FasterMoE reports 9.4 % faster iterations from this gate. Since the model now learns under
# a constraint, what finally counts is the time to reach a given loss, which FasterMoE measures end to
# end; here we only measure the layer.
#
# ### The gain with congestion present and absent
#
# The gate's rationale is the shared card: a worker may send only L = W_net / (M · W_local) · B rows
# out because the M workers of its node share W_net. The same gates on the same network with a card
# per rank (no congestion): what the link's model charged the all-to-alls (`args.emulated_s` plus the
# time queued behind the node's other rank, `args.emulated_queue_s`, summed per iteration on the
# busiest rank; exact, not noisy), and the measured step.


# %%
def link_ms(run):
    """Median over iterations (after the first) of the busiest rank's modelled all-to-all time, queueing
    on the card included, per iteration (forward and backward)."""
    per = {}
    for e in run.events:
        if e["name"] == "all_to_all" and "emulated_s" in e["args"]:
            step = (
                sum(
                    1
                    for f in run.events
                    if f["name"] == "forward" and f["rank"] == e["rank"] and f["start"] <= e["start"]
                )
                - 1
            )
            key = (step, e["rank"])
            per[key] = per.get(key, 0.0) + e["args"]["emulated_s"] + e["args"]["emulated_queue_s"]
    steps = sorted({s for s, _ in per if s >= 1})
    return statistics.median(max(v for (s, _), v in per.items() if s == step) for step in steps) * 1e3


print(f"{'card':<22}{'top-k: link':>12}{'topology: link':>16}{'gain':>7}{'top-k: step':>13}{'topology: step':>16}")
for card, suffix in (("shared (congestion)", ""), ("one per rank", ", own cards")):
    a, b = link_ms(runs["top-k gate" + suffix]), link_ms(runs["topology gate" + suffix])
    print(
        f"{card:<22}{a:>10.1f}ms{b:>14.1f}ms{a / b:>6.2f}x{step_ms('top-k gate' + suffix):>11.0f}ms"
        f"{step_ms('topology gate' + suffix):>14.0f}ms"
    )

# %% [markdown]
# With the card shared, every row that crosses waits for its node neighbour's rows as well, so the
# rows the gate keeps inside the node save about twice their own time; with a card per rank they save
# only their own. The gate's gain in link time is larger with congestion than without, which is the
# case FasterMoE designed it for (the step times carry this machine's compute noise on top).
#
# ## 4. Tutel, complete: 2DH all-to-all, EP+DP+MP, dynamic capacity
#
# Three more of Tutel's mechanisms, run in the launch above (4 ranks, 2 nodes of 2, card shared).
#
# ### The 2D hierarchical all-to-all
#
# A flat all-to-all over W ranks in N nodes of G sends W - 1 messages per rank, W - G of them across
# the network. Tutel's 2DH (`toolkit/comm/hierarchical.py`) first exchanges inside each node, so that
# local rank j collects every block its node has for local rank j of any node, then exchanges across
# nodes among the ranks of the same local index: G - 1 messages inside, N - 1 across, each G times
# larger. The result is the flat all-to-all's, row for row (`tests/test_moe_tutel.py` checks it, uneven
# splits included). Here the MoE layer's dispatch, first flat (`top-k gate`), then 2DH, as rank 0's
# trace shows them (uneven splits need a small count exchange first; Tutel pads to a fixed capacity
# instead):


# %%
def dispatch_calls(run):
    """Rank 0's all-to-alls of the first dispatch: (2DH step, group, rows sent per peer, bytes sent)."""
    calls = [e for e in run.comm_events(0, "all_to_all") if e["args"].get("moe") == "dispatch"]
    first = [e for e in calls if abs(e["start"] - calls[0]["start"]) < 1.0][:3]
    return [
        (e["args"].get("2dh", "flat"), e["args"]["group"], e["args"]["input_splits"], e["args"]["bytes_sent"])
        for e in (first if first[0]["args"].get("2dh") else first[:1])
    ]


for label in ("top-k gate", "2DH all-to-all"):
    print(label)
    for step, group, rows, sent in dispatch_calls(runs[label]):
        print(f"   {step:<12} group {group!s:<14} rows to each {rows!s:<22} {sent:>8,} bytes sent")
print(
    f"\nlink time per iteration (model): flat {link_ms(runs['top-k gate']):.1f} ms, "
    f"2DH {link_ms(runs['2DH all-to-all']):.1f} ms;  step: flat {step_ms('top-k gate'):.0f} ms, "
    f"2DH {step_ms('2DH all-to-all'):.0f} ms"
)

# %% [markdown]
# On 2 nodes of 2, 2DH saves nothing: a flat all-to-all sends 2 messages across per rank, 2DH 1, but
# pays a whole extra pass inside the node. It pays as nodes grow: the flat all-to-all's cross-node
# messages per rank grow with W, 2DH's with N only, while the bytes that cross are the same. The link's
# model (`toolkit.comm.hierarchical.predicted_times`, the emulator's own cost function, every rank
# issuing at once and each node's card shared) predicts both for this lesson's link and this layer's
# dispatch, as the number of nodes grows:

# %%
import plotly.graph_objects as go

from toolkit.comm.emulate import make_settings
from toolkit.comm.hierarchical import predicted_times

lesson_link = make_settings(
    link["bandwidth"] / 4, LATENCY_S, intra_node=(link["bandwidth"], LATENCY_S), ranks_per_node=2
)
per_rank_bytes = 256 * K * D * 4  # one rank's dispatch: T*k rows of d_model fp32
nodes = [1, 2, 4, 8, 16, 32, 64, 128]
model = {n: predicted_times(lesson_link, n, 2, per_rank_bytes) for n in nodes}
crossover = next((n for n in nodes if model[n]["2dh"] < model[n]["flat"]), None)
figure = go.Figure(
    [
        go.Scatter(x=nodes, y=[model[n][kind] * 1e3 for n in nodes], name=kind, mode="lines+markers")
        for kind in ("flat", "2dh")
    ]
)
figure.update_layout(
    title=f"One dispatch all-to-all, nodes of 2 ranks, this lesson's link: 2DH wins from {crossover} nodes",
    xaxis=dict(title="nodes", type="log"),
    yaxis=dict(title="modelled time (ms)", type="log"),
)
figure

# %%
dgx = make_settings("200 Gb/s", "5 us", intra_node=("300 GB/s", "2 us"), ranks_per_node=8)
print("nodes of 8 GPUs, 200 Gb/s per node, NVLink inside; 64 MB per GPU per all-to-all:")
print(f"{'nodes':>6}{'flat (ms)':>11}{'2DH (ms)':>10}{'messages flat':>15}{'2DH':>5}")
for n in (2, 4, 8, 16, 32, 64, 256):
    t = predicted_times(dgx, n, 8, 64e6)
    print(f"{n:>6}{t['flat'] * 1e3:>11.2f}{t['2dh'] * 1e3:>10.2f}{t['messages flat']:>15}{t['messages 2dh']:>5}")

# %% [markdown]
# Where the crossover lies follows from the model: 2DH saves (G - 1)(N - 1) message latencies per rank
# and pays a whole pass inside the node, (G - 1)/G · S bytes (the flat all-to-all's own intra-node part
# runs beside its cross-node part on another link), so it wins once N > 1 + S / (G · α · B_intra).
# Big messages on fast nodes push the crossover out, many small messages pull it in; the first arXiv
# version of the Tutel paper (arXiv 2206.03382v1) reports 2DH up to 20.7x faster than the previous
# all-to-all at 2,048 GPUs. (The model leaves out the local reordering, a memory copy GPUs pay on top.)
#
# ### EP+DP+MP: more ranks than experts
#
# With W > E each expert lives on W/E ranks, sliced along its hidden layer (`toolkit/moe/sharded.py`).
# Tutel's r chooses how a step runs on that storage: r = W/E computes each slice where it is stored and
# sends every row to all W/E slices of its expert (EP+MP); r = 1 gathers the whole expert on each of
# its ranks, which split its rows (EP+DP); DP gathers every expert everywhere. Same storage, same
# mathematics (the tests compare all three with the one-rank layer). Here E = 2 experts on W = 4
# ranks, r = 2 or 1, and DP, next to Tutel's table; bytes per rank per iteration, forward and backward,
# measured from the traces (mean over ranks):


# %%
def bytes_by_kind(run):
    """Mean over ranks of bytes sent per iteration: rows (all-to-all) and weights (gathers, reduce-scatters)."""
    n = len([e for e in run.events if e["name"] == "forward" and e["rank"] == 0])
    rows = sum(e["args"]["bytes_sent"] for e in run.events if e["name"] == "all_to_all") / 4 / n
    weights = (
        sum(
            e["args"]["bytes_sent"]
            for e in run.events
            if e["name"] in ("all_gather", "reduce_scatter") and e["args"].get("moe")
        )
        / 4
        / n
    )
    return rows, weights


P = 2 * (2 * D * FF + FF + D)  # the 2 experts' parameters
C_g = 256 * K  # rows one rank dispatches (dropless: T*k)
print(f"P = {P:,} expert parameters, C_g = {C_g} rows of d_model {D} per rank, W/E = 2")
print(f"{'placement':<12}{'Tutel':>18}{'rows (kB)':>11}{'weights (kB)':>14}{'total (kB)':>12}{'step (ms)':>11}")
for label, order in (("EP+MP, r=2", "O(C_g·W/E)"), ("EP+DP, r=1", "O(C_g + P/E)"), ("DP", "O(P)")):
    rows, weights = bytes_by_kind(runs[label])
    print(
        f"{label:<12}{order:>18}{rows / 1e3:>11.0f}{weights / 1e3:>14.0f}{(rows + weights) / 1e3:>12.0f}"
        f"{step_ms(label):>11.0f}"
    )
print(
    f"\nfor scale: 4 all-to-alls of C_g rows = {4 * C_g * D * 4 / 1e3:.0f} kB; P/E x 4 B = {P / 2 * 4 / 1e3:.0f} kB; "
    f"DP's all-gather + reduce-scatter 2 x 3/4 x P x 4 B = {1.5 * P * 4 / 1e3:.0f} kB"
)

# %% [markdown]
# Read the columns against Tutel's table: EP+MP moves only rows, about twice as many as EP+DP (each
# row goes to both slices of its expert), and no weights beyond the output bias; EP+DP moves each row
# once and gathers half an expert per rank (P/E/2 in, its gradient back); DP moves no row at all and
# the whole P. Which is cheapest depends on C_g against P, which is why Tutel keeps one layout that lets
# each step switch at no cost. Who decides differs: Tutel's released layer takes r (0 for DP) from the
# caller at every forward and the paper's adaptive search tries them; `expert_parallel="auto"` is the
# toolkit's own rule, which prices DP and every r with the emulated link's model and runs the cheapest.
#
# ### Dynamic capacity
#
# Notebook 05 fixed the capacity factor f. Tutel chooses the capacity per step from the load it
# observes: the fullest expert's count, agreed by all ranks, never more than a bound
# (`dynamic_capacity=True`, the bound `capacity_factor`; Tutel writes capacity_factor=-f). Three layers
# on the same batches, with a milder skew (Zipf 0.5, still drifting): f = 1 (slots for a balanced
# load), f = 4, and dynamic up to 4:

# %%
print(
    f"{'capacity':<14}{'C per iteration (rank 0)':>26}{'dropped':>9}{'padded rows':>13}{'kept rows':>11}"
    f"{'step (ms)':>11}"
)
for label in ("static f=1", "static f=4", "dynamic f<=4"):
    loads = [m["value"] for m in runs[label].metrics if m["name"] == "moe/moe/load"]
    capacities = [v["capacity"] for v in loads if v["first"] == 0]
    dropped = sum(v["dropped"] for v in loads) / sum(sum(v["counts"]) for v in loads)
    padded = sum(v["capacity"] * len(v["counts"]) for v in loads) // len(capacities)  # E*C per rank, summed
    kept = sum(sum(v["kept"]) for v in loads) // len(capacities)
    print(f"{label:<14}{capacities!s:>26}{dropped:>9.1%}{padded:>13}{kept:>11}{step_ms(label):>11.0f}")

# %% [markdown]
# f = 1 drops what the popular experts cannot hold; f = 4 drops nothing but gives every expert room for
# four times the balanced load; dynamic capacity drops nothing either and asks only for the slots the
# fullest expert needed this step. In this layer only kept rows travel, so the step times of f = 4 and
# dynamic are alike; in Tutel's padded (E, C, d) buffers every slot travels and is computed ("padded
# rows", all ranks, per iteration), so there dynamic capacity saves the difference every step, and more
# when the load is balanced.
#
# ## 5. What to take away
#
# | fix | what it changes on the timeline | on the roofline | when it pays |
# | --- | --- | --- | --- |
# | shadowing | weights travel (broadcast, gradient all-reduce), hot rows stay home, both ranks compute | right and up | strong skew, small experts, many tokens, slow link |
# | smart schedule | per-peer sends and receives interleaved with expert blocks | up, toward the ideal line | R_CC near 1, many ranks (more steps to overlap) |
# | pipelining | chunks of all-to-all interleaved with expert chunks | up | R_CC near 1; the degree must fit the workload |
# | topology gate | fewer rows on the slow link | right | slow links between nodes, skew across nodes |
# | 2DH all-to-all | fewer, larger messages across nodes, one extra pass inside | right | many nodes, small messages |
# | EP+DP+MP, r | rows to W/E slices (r = W/E) or slices gathered (r = 1) | right | more ranks than experts |
# | dynamic capacity | no drops, no empty slots | (fewer drops) | skew that changes from step to step |
#
# And the bench (`bench/moe_systems.py`, results in `docs/benchmarks.md`) measures all of them side by
# side, on loopback and on links calibrated for R_CC = 1 and 0.1, at 2 and 4 ranks.
#
# ## Questions
#
# 1. Section 1: with the counts printed by `explain()`, by hand: what is B_w for each rank, and B'_w
#    with the chosen experts shadowed? Why did Algorithm 1 stop where it stopped?
# 2. Section 1: the model's predicted latency is far below the measured one. Which traffic does
#    Lat_shadow leave out, and which traffic does Lat_imbl count that never crosses a link?
# 3. Section 2: on 2 ranks, what fraction of the dispatch can the smart schedule hide at most? How does
#    that change with 8 ranks?
# 4. Section 2: why would a very large pipeline degree be slower even with an infinitely fast link?
# 5. Section 3: with W_net = 10 GB/s between nodes, W_local = 40 GB/s inside, 8 GPUs per node and
#    4096 rows per GPU, how many rows may leave the node per GPU?
