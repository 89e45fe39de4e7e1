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
# # 01 · Collectives: how ranks talk
#
# Data-parallel training runs the same model in several processes, called **ranks**, each on its own
# slice of the batch. After every backward pass the ranks hold different gradients, and before the
# optimizer step they must agree on one. They agree through **collectives**: operations that every
# rank of a group calls together and that move data between all of them at once.
#
# This notebook starts real ranks on this machine (4 processes talking through `torch.distributed`
# with the gloo backend; on GPUs the same code uses NCCL) and uses them to
#
# 1. show what the five collectives do, on tensors small enough to read;
# 2. check numerically that an all-reduce is a reduce-scatter followed by an all-gather;
# 3. walk through the ring algorithm step by step, and see why it sends 2(N-1)/N of the data;
# 4. write down the alpha-beta cost model;
# 5. measure bandwidth against message size, the backend's collectives against hand-written ring
#    ones, with the model fitted on top;
# 6. look at the timeline of what every rank did;
# 7. leave you a panel to launch your own.
#
# It runs top to bottom in about a minute on a 2-core laptop.

# %%

import toolkit
from toolkit import viz
from toolkit.comm import measure
from toolkit.memory import alpha_beta_time, ring_all_reduce_bytes

WORLD = 4  # ranks per launch; on a 2-core laptop they share the cores, which is fine for learning

# %% [markdown]
# ## 1. Five collectives on tiny tensors
#
# `toolkit.launch(fn, world_size)` starts `world_size` fresh Python processes, sets up the process group
# in each, runs `fn()` on every one of them and hands back the return values in rank order. Inside `fn`,
# the collectives come from `toolkit.comm`, which records every call (operation, size, bytes sent and
# received) before running it.
#
# Each rank starts with numbers that tell where they came from: rank `r` holds `10r, 10r+1, ...`.
# So in every result, the tens digit says which rank a number came from, and a sum shows up as a
# number no single rank had.
#
# | collective | what every rank ends with | where training uses it |
# | --- | --- | --- |
# | all-reduce | the element-wise sum of everyone's tensor | averaging gradients in data parallelism (DDP) |
# | reduce-scatter | one 1/N slice of that sum: rank r gets slice r | sharded gradients (ZeRO-2, FSDP) |
# | all-gather | everyone's slices, concatenated in rank order | rebuilding sharded parameters (ZeRO-3, FSDP) |
# | broadcast | a copy of one rank's tensor | making every replica start from the same weights |
# | all-to-all | block j of every rank's tensor, on rank j (a transpose of blocks) | sending tokens to their experts (MoE) |


# %%
def tiny_collectives():
    """Run each collective once on small, readable tensors; return what this rank held before and after."""
    import torch
    import torch.distributed as dist

    from toolkit import comm

    r, n = dist.get_rank(), dist.get_world_size()
    mine = torch.arange(float(n)) + 10 * r  # with 4 ranks, rank 2 holds [20, 21, 22, 23]
    seen = {}

    x = mine.clone()
    comm.all_reduce(x)
    seen["all_reduce"] = (mine, x)

    slice_of_sum = torch.empty(1)  # n elements in, one out: element r of the sum
    comm.reduce_scatter(slice_of_sum, mine)
    seen["reduce_scatter"] = (mine, slice_of_sum)

    piece = mine[:2].clone()
    everyone = torch.empty(2 * n)
    comm.all_gather(everyone, piece)
    seen["all_gather"] = (piece, everyone)

    x = mine.clone()
    comm.broadcast(x, src=2)
    seen["broadcast (from rank 2)"] = (mine, x)

    received = torch.empty(n)  # element j of `mine` is meant for rank j
    comm.all_to_all(received, mine)
    seen["all_to_all"] = (mine, received)
    return seen


def show(results, title):
    print(title)
    for rank, seen in enumerate(results):
        before, after = seen[title]
        print(f"  rank {rank}: {[int(v) for v in before.tolist()]!s:<18} -> {[int(v) for v in after.tolist()]}")
    print()


results = toolkit.launch(tiny_collectives, WORLD)
for title in results[0]:
    show(results, title)

# %% [markdown]
# Read the results row by row:
#
# - **all-reduce**: every rank ends with `[60, 64, 68, 72]` = `0+10+20+30`, `1+11+21+31`, ... All four now
#   hold the same tensor, which is exactly what averaged gradients must be.
# - **reduce-scatter**: the same sums, but rank `r` keeps only element `r`. Nobody holds the whole sum;
#   together they do, in a quarter of the memory each.
# - **all-gather**: each rank gave two numbers; every rank ends with all eight, in rank order.
# - **broadcast**: rank 2's tensor replaced everyone's.
# - **all-to-all**: rank `r` ends with element `r` of every rank: `[r, 10+r, 20+r, 30+r]`. Viewed as a
#   4 x 4 matrix (row = sender, column = receiver) it is a transpose.

# %% [markdown]
# ## 2. all-reduce = reduce-scatter + all-gather
#
# Reduce-scatter leaves rank `r` with the fully reduced slice `r`. All-gather then gives every slice to
# every rank. Put together, every rank holds the whole reduced tensor: an all-reduce. This is not just
# an identity on paper; it is how NCCL's ring all-reduce works, and how ZeRO and FSDP split the
# all-reduce of data parallelism in two halves that they can schedule separately.
#
# Below, every rank draws a different random tensor and reduces it three ways: the backend's
# all-reduce, reduce-scatter followed by all-gather, and the hand-written ring all-reduce of
# `toolkit.comm.ring` (switched on with `comm.using("ring")`). The door also recorded the bytes each
# call sent, which we compare with the formulas.


# %%
def three_ways(numel):
    import torch
    import torch.distributed as dist

    from toolkit import comm
    from toolkit.trace import recorder

    r, n = dist.get_rank(), dist.get_world_size()
    x = torch.randn(numel, generator=torch.Generator().manual_seed(r))

    direct = x.clone()
    comm.all_reduce(direct)

    my_slice = torch.empty(numel // n)
    comm.reduce_scatter(my_slice, x)  # rank r: slice r of the sum
    in_two_halves = torch.empty(numel)
    comm.all_gather(in_two_halves, my_slice)  # everyone: every slice

    with comm.using("ring"):
        ring = x.clone()
        comm.all_reduce(ring)

    sent = [(e["name"], e["args"]["impl"], e["args"]["size_bytes"], e["args"]["bytes_sent"]) for e in recorder.events]
    return direct, in_two_halves, ring, sent


numel = 100_000
direct, halves, ring, sent = toolkit.launch(three_ways, WORLD, args=(numel,))[0]
print(f"rank 0, {numel} float32 values summed over {WORLD} ranks:")
print(f"  max |all_reduce - all_gather(reduce_scatter)| = {(direct - halves).abs().max().item():.2e}")
print(f"  max |all_reduce - ring all_reduce|            = {(direct - ring).abs().max().item():.2e}")
print("\nbytes rank 0 sent, as recorded by toolkit.comm:")
for name, impl, size, nbytes in sent:
    print(f"  {name:<15} ({impl:<7}) of {size:>7} B: sent {nbytes:>7} B = {nbytes / size:.2f} x size")

# %% [markdown]
# The three results agree to within floating-point rounding (summing in a different order changes
# the last bit or so; exact equality would be luck). And the byte counts add up: the reduce-scatter
# and the all-gather each send (N-1)/N = 0.75 of the tensor, and together they send 1.5 = 2(N-1)/N
# times it, which is exactly what one all-reduce sends.

# %% [markdown]
# ## 3. The ring algorithm
#
# Why 2(N-1)/N? Arrange the N ranks in a circle, each with a left and a right neighbour, and cut the
# tensor into N chunks.
#
# - **Reduce-scatter half** (N-1 steps): at every step each rank sends one chunk to its right
#   neighbour and receives one from its left, which it adds to its own copy of that chunk. The
#   schedule is arranged so that a chunk picks up one more rank's contribution at every hop; after
#   N-1 hops, chunk `r` has visited everyone and sits, complete, on rank `r`.
# - **All-gather half** (N-1 more steps): the complete chunks travel around the same ring, copied
#   rather than added, until every rank has all of them.
#
# Every step, every rank sends one chunk (1/N of the tensor) and receives one, so all links are busy
# at once and none carries more than the others. Total per rank: 2(N-1) steps x 1/N of the tensor.
#
# The simulation below does the bookkeeping without tensors: each cell shows *whose contributions*
# chunk c on rank r contains so far (`0123` means complete). It uses the same schedule as
# `toolkit/comm/ring.py`: at reduce-scatter step s rank r sends chunk (r-s-1) mod N; at all-gather
# step s it forwards chunk (r-s) mod N.


# %%
def show_holdings(holdings, label):
    n = len(holdings)
    width = max(len("chunk 0"), n) + 2
    print(f"{label:<24}" + "".join(f"chunk {c}".ljust(width) for c in range(n)))
    for r, row in enumerate(holdings):
        print(f"{'  rank ' + str(r):<24}" + "".join("".join(map(str, sorted(h))).ljust(width) for h in row))


def simulate_ring_all_reduce(n):
    """Track which ranks' contributions every chunk on every rank holds, step by step."""
    holdings = [[{r} for _ in range(n)] for r in range(n)]  # at first, each rank has only its own data
    show_holdings(holdings, "start")
    for s in range(n - 1):  # reduce-scatter: receive and add
        messages = [((r + 1) % n, (r - s - 1) % n, set(holdings[r][(r - s - 1) % n])) for r in range(n)]
        for receiver, chunk, contents in messages:  # all messages of a step travel at once
            holdings[receiver][chunk] |= contents
        show_holdings(holdings, f"reduce-scatter step {s + 1}")
    for s in range(n - 1):  # all-gather: receive and keep
        messages = [((r + 1) % n, (r - s) % n, set(holdings[r][(r - s) % n])) for r in range(n)]
        for receiver, chunk, contents in messages:
            holdings[receiver][chunk] = contents
        show_holdings(holdings, f"all-gather step {s + 1}")
    return holdings


final = simulate_ring_all_reduce(4)
assert all(h == {0, 1, 2, 3} for row in final for h in row), "the ring left a chunk incomplete"

# %% [markdown]
# After reduce-scatter step 3, the diagonal is complete: rank r owns chunk r. After all-gather step 3,
# every cell is. The same schedule, as a picture (hover a cell for what happens in it):

# %%
viz.ring_schedule(4)

# %% [markdown]
# ### Its cost: 2(N-1)/N, almost independent of N
#
# Each rank sends 2(N-1)/N times the tensor, whatever N is. For large N this tends to 2: adding ranks
# hardly increases the bytes per rank, which is why data parallelism with ring all-reduce scales to
# thousands of GPUs. What does grow with N is the number of steps, 2(N-1), and each step pays a fixed
# latency, as the next section makes precise.

# %%
size = 1e9  # a 1 GB gradient buffer
print(f"{'N':>6} {'bytes sent per rank':>22} {'x size':>8} {'steps':>7}")
for n in (2, 4, 8, 64, 1024):
    sent_bytes = ring_all_reduce_bytes(size, n)
    print(f"{n:>6} {sent_bytes / 1e9:>19.3f} GB {sent_bytes / size:>8.3f} {2 * (n - 1):>7}")

# %% [markdown]
# ## 4. The alpha-beta model
#
# The simplest useful model of a message: it costs a fixed latency **α** (seconds: software overhead,
# synchronisation, the first byte's trip) plus **β** seconds per byte (β = 1 / bandwidth). An algorithm
# that takes `steps` rounds and sends `bytes` per rank then takes
#
# $$ T = \text{steps}\cdot\alpha + \text{bytes}\cdot\beta, \qquad
#    T_\text{ring all-reduce} = 2(N-1)\,\alpha + \tfrac{2(N-1)}{N}\,S\,\beta .$$
#
# Small messages are latency-bound (the α term dominates), large ones bandwidth-bound (the β term).
# The two terms are equal at S = Nα/β. `toolkit.memory.alpha_beta_time` implements the model for each
# collective. With numbers in the range of a GPU node (α = 5 µs, 1/β = 100 GB/s) on 8 ranks:

# %%
alpha, beta, n = 5e-6, 1 / 100e9, 8
print(f"crossover size N*alpha/beta = {n * alpha / beta / 1e6:.1f} MB")
print(f"{'size':>10} {'time':>10} {'latency share':>14} {'algbw':>12}")
for s in (1e3, 1e5, 1e6, 1e7, 1e8, 1e9):
    t = alpha_beta_time("all_reduce", s, n, alpha, beta)
    latency = 2 * (n - 1) * alpha
    print(f"{s / 1e6:>8.3f}MB {t * 1e3:>8.3f}ms {latency / t:>13.0%} {s / t / 1e9:>8.2f} GB/s")

# %% [markdown]
# ## 5. Measured: bandwidth against message size
#
# Now the real thing. `measure.measure_collectives` launches the ranks and, for each collective, size
# and implementation, warms up, then times a few repetitions. Every repetition starts right after a
# barrier, and its time is the slowest rank's (a collective is finished when the last rank is). The
# record keeps the median over repetitions and checks that backend and hand-written results agree.
#
# Two bandwidths, as in NVIDIA's `nccl-tests`:
#
# - **algbw** = size / time: how fast the operation went, from the user's point of view;
# - **busbw** = algbw x a factor (all-reduce 2(N-1)/N; reduce-scatter, all-gather, all-to-all (N-1)/N;
#   broadcast 1): how fast the busiest link went. It is comparable across collectives and with the
#   hardware's link speed.
#
# A caveat: here 4 ranks share 2 CPU cores and gloo moves bytes through memory, so the absolute
# numbers are far from a GPU network's. Read the *shapes* and the *ratios*, measured side by side.

# %%
sizes = (4 * measure.KiB, 64 * measure.KiB, 1 * measure.MiB)
records, run = measure.measure_collectives(WORLD, sizes=sizes, warmup=1, repeats=3)
print(measure.format_table(records))

# %% [markdown]
# Fitting α and β to the ring's measurements gives this machine's own model; dotted lines show it.
# (On a shared, oversubscribed CPU the fit is rough: a time slice lost to another process looks like
# latency.)

# %%
alpha_fit, beta_fit = viz.fit_alpha_beta(records)
print(
    f"fitted alpha = {alpha_fit * 1e6:.0f} µs per step, 1/beta = {1 / beta_fit / 1e9:.2f} GB/s"
    if beta_fit > 0
    else f"fitted alpha = {alpha_fit * 1e6:.0f} µs per step, beta = 0"
)
viz.bandwidth(records, model=(alpha_fit, beta_fit))

# %%
viz.collective_times(records, model=(alpha_fit, beta_fit))

# %% [markdown]
# Things to look for:
#
# - bandwidth rises with message size: small messages pay latency for few bytes;
# - the time curves are flat on the left (α-bound) and turn upward on the right (β-bound), like the model;
# - busbw brings the collectives closer together than algbw does: that factor is the bytes each link
#   really carried;
# - the hand-written ring, in Python on point-to-point messages, pays more per step than gloo's C++,
#   which shows most at small sizes, where steps dominate.

# %% [markdown]
# ## 6. The timeline
#
# The same run, drawn as what every rank did and when: one lane per rank, communication above
# compute (here "compute" is preparing inputs and checking agreement). Colours are operations; hatched
# spans ran on the hand-written implementation. Hover a span for its bytes, duration and achieved
# bandwidth; drag to zoom. Here only the all-reduce measurements are shown.

# %%
viz.timeline(run, phase="all_reduce/", title="All-reduce measurements, backend then ring, by size")

# %% [markdown]
# Notice that the ranks do not finish a collective at the same moment: a rank that arrives early
# waits inside the call for the others. That waiting is part of the collective's time, which is why
# the measurement reports the slowest rank. To explore the whole run, `toolkit.trace.chrome.save_chrome(run, path)`
# writes a Chrome trace for ui.perfetto.dev.

# %% [markdown]
# ## 7. Your turn: the panel
#
# Pick an operation, a message size, a world size and the implementation, then press the button: it
# launches the ranks, measures, and redraws the timeline below it. (Nothing runs until you press.)

# %%
panel = viz.collective_panel()
panel

# %% [markdown]
# ## Questions
#
# 1. With the model of section 4, at what message size does an 8-rank ring all-reduce reach half of its
#    peak algbw? How does that size change with N?
# 2. Reduce-scatter and all-gather each cost (N-1)/N of the tensor. Why does ZeRO-3, which all-gathers
#    parameters twice and reduce-scatters gradients once per step, send 1.5 times what data parallelism does?
# 3. In the panel, compare the ring's all-reduce on 2 and on 4 ranks at a small size. Which term of
#    the model grew?
