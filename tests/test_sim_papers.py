"""The papers' numbers as expected values: FasterMoE's Table 2 from the toolkit's MoE models built on meta,
its DDL-roofline and Algorithm 1 on the cost model, Tutel's adaptive pipelining degree, and the FSDP
paper's GPT-175B throughput and full-versus-hybrid trend, predicted by the simulator and the cost model.
Each test states its tolerance and what the model cannot reproduce."""

import functools

import pytest
import torch

from toolkit.models import GPT, GPTConfig, tiny_gpt
from toolkit.models.moe_gpt import moe_gpt
from toolkit.sim import held_to_runs

# --- FasterMoE Table 2: parameters = L (2 alpha E + 4) H^2 --------------------------------------------------
TABLE_2 = {  # name -> (size in the paper, layers, experts, H); alpha = 2 for every model
    "MoE-GPT-S": (0.86e9, 12, 16, 1024),
    "MoE-GPT": (3.42e9, 12, 16, 2048),
    "MoE-GPT-L": (13.7e9, 12, 16, 4096),
    "MoE-BERT-Deep": (1.71e9, 24, 16, 1024),
    "MoE-BERT-Deep-L": (27.4e9, 24, 16, 4096),
    "MoE-BERT-Wide": (3.27e9, 12, 64, 1024),
    "MoE-BERT-Wide-L": (13.1e9, 12, 64, 2048),
}


@pytest.mark.parametrize("name", TABLE_2)
def test_fastermoe_table_2_parameter_counts_from_the_real_models_built_on_meta(name):
    """The table counts the weight matrices of attention (4H^2) and of the experts (2 alpha H^2 each):
    exactly L (2 alpha E + 4) H^2 in the model the toolkit builds, and that rounds to the paper's size
    (3 significant digits). Embeddings, biases, norms and routers come on top (reported, not in the table)."""
    size, layers, experts, H = TABLE_2[name]
    alpha = 2
    with torch.device("meta"):
        model = moe_gpt(
            experts, 2, n_layer=layers, d_model=H, n_head=16, d_ff=alpha * H, vocab_size=50257, seq_len=1024
        )
    counted = 0
    for block in model.blocks:
        counted += block.attn.qkv.weight.numel() + block.attn.proj.weight.numel()
        counted += block.mlp.experts.w1.numel() + block.mlp.experts.w2.numel()
    assert counted == layers * (2 * alpha * experts + 4) * H * H
    assert float(f"{counted:.3g}") == pytest.approx(size, rel=0.005), f"{name}: {counted / 1e9:.3f}B"
    total = sum(p.numel() for p in model.parameters())
    assert 0 < total - counted < 0.1 * total  # the rest: embeddings, biases, norms, routers


# --- FSDP paper: GPT-175B on 128-512 A100 ------------------------------------------------------------------
# The paper's cluster: A100 80GB, 8 per node on NVLink, 2 Tb/s RoCE per node (250 Gb/s per GPU); NCCL's
# latencies. It is the DGX A100 preset with the paper's cards: its kernels and NVLink at their published rates,
# the cards at the fraction of their datasheet rate NCCL reaches on HDR (toolkit.sim.published). Its
# configuration: full sharding, bf16, activation checkpointing, backward prefetch, and forward prefetch (torch
# FSDP's CPU runs ahead and issues the next unit's all-gather early; the toolkit's FSDP does that only when asked,
# forward_prefetch=True), a batch of 1 sequence of 2048 per GPU.
PAPER_TFLOPS = (173, 186)
TOLERANCE = 0.15


def fsdp_paper_cluster(inter_node="250 Gb/s"):
    from toolkit.sim import cluster_of

    return cluster_of(
        "dgx-a100",
        name="fsdp-paper",
        inter=(inter_node, "9.6 us"),
        source="FSDP paper, section 6: DGX A100 nodes, 2 Tb/s RoCE per node",
    )


def gpt3_fsdp(world, layers=96, inter_node="250 Gb/s", **options):
    """minGPT-175B, the paper's model, with the kernels minGPT runs (`toolkit.models.as_in_papers`)."""
    from toolkit.models.as_in_papers import as_in
    from toolkit.models.presets import gpt3_175b
    from toolkit.sim import simulate

    return simulate(
        lambda: as_in(gpt3_175b(n_layer=layers), "mingpt"),
        "fsdp",
        world,
        batch_per_rank=1,
        mixed_precision=True,
        activation_checkpointing=True,
        forward_prefetch=True,
        warmup=False,
        progress=False,
        cluster=fsdp_paper_cluster(inter_node),
        **options,
    )


def assert_in_papers_band(sim):
    low, high = PAPER_TFLOPS[0] * (1 - TOLERANCE), PAPER_TFLOPS[1] * (1 + TOLERANCE)
    assert low <= sim.tflops_per_gpu <= high, (
        f"{sim.world_size} GPUs: {sim.tflops_per_gpu:.1f} TFLOP/s per GPU, "
        f"paper {PAPER_TFLOPS}, tolerance {TOLERANCE:.0%}"
    )


def test_fsdp_paper_gpt_175b_throughput_and_hybrid_sharding_on_8_of_its_layers():
    """8 of GPT-3's 96 layers (same width, heads and sequence; the embedding and head as in the full model):
    per-GPU throughput is the ratio of a layer's compute (every operation priced at its published rate, slowed
    beside the collectives it overlaps) to the communication it cannot hide, so it lands in the paper's band
    (173-186 TFLOP/s within 15%; 177 for these 8 layers, 181-182 for the whole model), flat from 128 to 512 GPUs
    as the paper's scaling is. (The whole 96-layer model: the `papers` test below, `make test-papers`.)

    Full against hybrid sharding: hybrid sharding sends 2/3 of full sharding's bytes across nodes per GPU
    (the paper's 2M(W-1)/(GW) against 3M(W-1)/W, both at the node's cards); its all-reduce over the
    replicas runs behind the next units' backward (as torch FSDP runs it), so most of it is hidden. The
    paper's trend follows: on a slow network between nodes hybrid sharding (shard within a node) is
    faster than full sharding; on the paper's 2 Tb/s per node full sharding is not slower, since a
    replica holds 1/8 of the model and its optimizer step costs more."""
    sims = {w: gpt3_fsdp(w, layers=8) for w in (128, 512)}
    for sim in sims.values():
        assert_in_papers_band(sim)
        assert sim.breakdown["exposed_comm"] < 0.05 * sim.step_time  # prefetching hides it
    assert sims[512].tflops_per_gpu == pytest.approx(sims[128].tflops_per_gpu, rel=0.02)

    hybrid = gpt3_fsdp(512, layers=8, sharding_group_size=8)
    spans = [s for s in hybrid.cost.timelines[-1].spans if s.kind == "comm"]
    replica = [s for s in spans if s.cost.link == "inter-node"]
    assert replica and all(s.instruction.op == "all_reduce" for s in replica)  # the only cross-node traffic

    def bandwidth_time(spans):  # the bytes' part of the time (latencies differ: 511-step rings against 63-step ones)
        return sum(s.end - s.start - s.cost.latency for s in spans)

    full = [s for s in sims[512].cost.timelines[-1].spans if s.kind == "comm"]
    # the paper's 2/3 of the bytes; the times differ by a few percent more, the two rings running at the cards'
    # measured rate with NCCL's latency per network step (511-step rings against 63-step ones)
    assert bandwidth_time(replica) / bandwidth_time(full) == pytest.approx(2 / 3, rel=0.06)
    hybrid_cross = sum(s.end - s.start for s in replica)
    exposed_replica = sum(
        w.end - w.start
        for w in hybrid.cost.timelines[-1].spans
        if w.kind == "wait" and w.instruction.id in {s.instruction.id for s in replica}
    )
    assert exposed_replica < 0.35 * hybrid_cross  # the rest runs behind the next units' backward
    assert sims[512].tflops_per_gpu >= hybrid.tflops_per_gpu
    slow = "25 Gb/s"  # a tenth of the paper's network per GPU: cross-node traffic is the bottleneck
    assert (
        gpt3_fsdp(512, layers=8, inter_node=slow, sharding_group_size=8).tflops_per_gpu
        > 1.1 * gpt3_fsdp(512, layers=8, inter_node=slow).tflops_per_gpu
    )


@pytest.mark.papers  # a few minutes on 2 cores: `make test-papers`
@pytest.mark.timeout(1200)
def test_fsdp_paper_gpt_175b_whole_model_on_128_256_512_gpus():
    """The whole 96 layers (three and four simulated, extrapolated: `toolkit.sim.sweep`) inside the paper's own band,
    173-186 TFLOP/s, not just within 15% of it: 181.2 at 128 GPUs, 182.0 at 512 when last measured; the band of the
    published measurements' spread around it (about 173 to 199) reaches below the paper's top."""
    from toolkit.sim.sweep import extrapolate

    for world in (128, 256, 512):
        whole = extrapolate(gpt3_fsdp(world, layers=3), gpt3_fsdp(world, layers=4), 96)
        assert PAPER_TFLOPS[0] <= whole["tflops_per_gpu"] <= PAPER_TFLOPS[1], (world, whole["tflops_per_gpu"])
        band = [whole["useful_flops"] / seconds / 1e12 for seconds in (whole["band"]["worst"], whole["band"]["best"])]
        assert band[0] < PAPER_TFLOPS[1] < band[1], (world, band)


# --- Megatron-LM's weak-scaling table (Narayanan et al., SC21, Table 1) ----------------------------------------
def megatron_table():
    from bench_module import load

    return load("megatron_table")


MEGATRON = megatron_table()


@functools.cache
def megatron_prediction(i: int, plain: bool = False, kernels: str | None = None) -> dict:
    return MEGATRON.predict(MEGATRON.row(i), plain=plain, kernels=kernels)


@pytest.mark.papers  # 10 s to 6 min per row on 2 cores (the 1T row's pipeline has 64 stages, 512 micro-batches)
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("i", range(1, len(MEGATRON.TABLE) + 1))
def test_megatron_weak_scaling_table_within_15_percent_per_row(i):
    """Each row's per-GPU TFLOP/s (the paper's FLOP count over the predicted step time), in the paper's own
    configuration (`bench/megatron_table.py`: its artifact's micro-batches, DDP and schedule), priced from
    published measurements of the hardware only (`toolkit.sim.published`): within 15% of what the paper measured
    (+6 / +3 / +1 / +6 / -4 / +6 / +3 / +3 / +4 / -0% when last measured), and the paper's number inside the
    prediction's band widened by the tolerance."""
    r = MEGATRON.row(i)
    got = megatron_prediction(i)
    said = f"row {i} ({r['params']}B): predicted {got['predicted']:.0f} TFLOP/s per GPU, paper {r['paper']}"
    assert abs(got["error"]) <= MEGATRON.TOLERANCE, said
    assert held_to_runs.group_of(f"megatron-table-1-row-{i}", "dgx-a100").covers(got["error"]), said  # as stated
    low, high = got["band"]["worst"], got["band"]["best"]
    assert low <= got["predicted"] <= high and low * (1 - MEGATRON.TOLERANCE) <= r["paper"], said


PLAIN_MISSES = {  # row -> the plain configuration's prediction when last measured (docs/differences.md says why)
    1: "228 TFLOP/s per GPU against 137 (+67%)",
    2: "204 against 138 (+48%)",
    3: "185 against 142 (+30%)",
    4: "174 against 135 (+29%)",
    5: "165 against 138 (+20%)",
    6: "166 against 140 (+18%)",
}
PLAIN_WHY = (
    "the plain configuration runs FlashAttention-2 (2023) without dropout where the paper's runs ran "
    "Megatron-LM's 2021 attention (baddbmm, fused softmax, dropout, bmm): at s = 2,048 FlashAttention-2's "
    "own figure puts it 2-5x above the standard path (A100: 140-187 against 17-76 TFLOP/s), and attention is "
    "s/6h of a layer's FLOPs, 15% in row 1 falling to 1.3% in row 10, so the plain rows sit above the paper "
    "by about that share; the same configuration with the paper's attention kernels (the test below) is within 15% "
    "in every row (+9 / +7 / +9 / +15 / +9 / +10% for rows 1-6 when last measured)"
)


@pytest.mark.papers
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("i", range(1, len(MEGATRON.TABLE) + 1))
def test_megatron_table_in_the_configuration_a_student_writes(i):
    """The plain configuration (`bench/megatron_table.py --plain`: the toolkit's GPT as it comes, activation
    checkpointing, torch's AdamW, 1F1B): rows 7-10 within 15% (+12 / +11 / +9 / +11%); rows 1-6 above by more, and
    say why (PLAIN_WHY); one that comes within fails until it is taken off PLAIN_MISSES."""
    r = MEGATRON.row(i)
    got = megatron_prediction(i, plain=True)
    said = f"row {i} plain: predicted {got['predicted']:.0f} TFLOP/s per GPU, paper {r['paper']}"
    within = abs(got["error"]) <= MEGATRON.TOLERANCE
    if i in PLAIN_MISSES:
        assert not within and got["error"] > 0, said + ": now within 15% (or below); take it off PLAIN_MISSES"
        pytest.xfail(f"{said} ({PLAIN_MISSES[i]}): {PLAIN_WHY}")
    assert within, said


def test_the_papers_kernels_are_asked_for_with_the_plain_configuration(capsys):
    """The artifact's configuration runs Megatron-LM's kernels already: `--kernels` alone is a mistake, said as the
    command line's."""
    with pytest.raises(SystemExit) as stopped:
        MEGATRON.main(["--kernels", "megatron", "--rows", "1"])
    assert stopped.value.code == 2 and "--kernels goes with --plain" in capsys.readouterr().err


@pytest.mark.papers  # a few seconds a row
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("i", sorted(PLAIN_MISSES))
def test_the_plain_rows_distance_from_the_paper_is_their_attention(i):
    """PLAIN_WHY, measured: the configuration a student writes with the paper's attention kernels put back
    (`bench/megatron_table.py --plain --kernels megatron`; everything else the student's: activation checkpointing,
    torch's AdamW, the toolkit's DDP buckets, plain 1F1B) comes within 15% of the paper in each row the plain one
    misses, and below the plain one."""
    r = MEGATRON.row(i)
    got = megatron_prediction(i, plain=True, kernels="megatron")
    said = f"row {i} plain, Megatron's attention: predicted {got['predicted']:.0f} TFLOP/s per GPU, paper {r['paper']}"
    assert abs(got["error"]) <= MEGATRON.TOLERANCE, said
    assert got["predicted"] < megatron_prediction(i, plain=True)["predicted"], said


@pytest.mark.papers
@pytest.mark.timeout(3600)
def test_megatron_weak_scaling_table_rises_with_model_size_as_the_paper_does():
    """The paper's rate rises with model size: rows 7-10 run 1.14x rows 1-4; the prediction's 1.12x when last
    measured (0.97x while a backward's send to the stage before waited behind the data-parallel reductions and the
    cool-down chained them along the pipeline: `toolkit.parallel.pipeline.driver` sends it from inside the backward,
    as Megatron-LM does)."""
    paper = [MEGATRON.row(i)["paper"] for i in range(1, 11)]
    predicted = [megatron_prediction(i)["predicted"] for i in range(1, 11)]
    rise = (sum(predicted[-4:]) / sum(predicted[:4])) / (sum(paper[-4:]) / sum(paper[:4]))
    assert rise == pytest.approx(1.0, abs=0.05), rise


@pytest.mark.papers
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("i", range(1, len(MEGATRON.TABLE) + 1))
def test_megatron_weak_scaling_rows_fit_in_the_gpus_memory(i):
    """The paper ran every row on 80 GB A100s: the simulated peak of the first stage (the embedding and, under
    1F1B, the most micro-batches in flight) must fit too (46-74 GB, row 4 accumulating its micro-batches as it ran;
    136-323 GB when recomputation's FLOP count kept the recomputed activations alive, issue 21)."""
    fit = megatron_prediction(i)["fit"]
    assert fit.fits, f"row {i}: {fit.text()}"


@pytest.mark.papers  # about a minute on 2 cores
@pytest.mark.timeout(1200)
def test_megatron_figure_15_tensor_parallelism_loses_to_data_parallelism_and_falls_off_a_cliff_across_nodes():
    """Narayanan et al.'s Figure 15 (`examples/sc21/run_figure_15.sh`): a 5.9B GPT on 64 A100s as tp x dp,
    micro-batches of one sequence. The paper's finding: the per-GPU rate falls as tp grows, at every batch
    size. The simulator keeps that ranking at batches of 128 and 512, and shows why: the tensor-parallel
    all-reduces, on the critical path, grow with tp while the data-parallel one shrinks; past 8 (a node), they
    cross the network, and each doubling costs more than any doubling inside the node (when last measured, at a
    batch of 128: 12% and 18% inside, 29% and 38% past it)."""
    for batch in (128, 512):
        runs = {tp: MEGATRON.predict(MEGATRON.figure_15(tp, batch)) for tp in (2, 4, 8, 16, 32)}
        rates = [runs[tp]["predicted"] for tp in sorted(runs)]
        assert rates == sorted(rates, reverse=True), (batch, rates)
        kept = [wider / narrower for narrower, wider in zip(rates, rates[1:])]  # tp 2->4, 4->8 | 8->16, 16->32
        assert max(kept[2:]) < min(kept[:2]), (batch, kept)
        exposed = [runs[tp]["breakdown"]["exposed_comm"] for tp in sorted(runs)]
        assert exposed == sorted(exposed), (batch, exposed)


@pytest.mark.papers  # several minutes on 2 cores: five layouts of a 162B model, pipelines up to 32 stages
@pytest.mark.timeout(3600)
def test_megatron_figure_13_tensor_as_wide_as_a_node_and_the_pipeline_across_nodes_is_best():
    """Narayanan et al.'s Figure 13 (`examples/sc21/run_figure_13.sh`): a 162.2B GPT on 64 A100s as pp x tp,
    128 sequences in micro-batches of one. The paper's ranking: tp 8 x pp 8 is the fastest. The simulator,
    running the pipeline's own schedule on every layout, ranks the same way, for the paper's reasons: wider tp
    leaves the node (its all-reduces cross the network), deeper pipelines wait longer ((p-1)/(m+p-1))."""
    runs = {pp: MEGATRON.predict(MEGATRON.figure_13(pp)) for pp in (2, 4, 8, 16, 32)}
    rates = {pp: r["predicted"] for pp, r in runs.items()}
    assert max(rates, key=rates.get) == 8, rates
    assert runs[4]["breakdown"]["exposed_comm"] > runs[8]["breakdown"]["exposed_comm"]  # tp 16: across nodes
    assert runs[32]["breakdown"]["bubble"] > runs[16]["breakdown"]["bubble"] > runs[8]["breakdown"]["bubble"]


def test_the_fused_adamw_stand_in_is_torchs_adamw_and_is_recorded_as_one_kernel():
    """`toolkit.sim.fused_adam.FusedAdamW` (the papers' fused optimizer, which torch refuses on meta tensors)
    takes the steps torch's AdamW takes, within fp32 rounding over ten steps (two updates of a value that is
    rounded differently differ by a few ulps: 1e-6 relative), and a simulated step records it as one operation."""
    from toolkit.models import tiny_gpt
    from toolkit.sim import simulate
    from toolkit.sim.fused_adam import FusedAdamW

    torch.manual_seed(0)
    a, b = torch.nn.Linear(7, 15), torch.nn.Linear(7, 15)
    b.load_state_dict(a.state_dict())
    settings = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    optimizers = torch.optim.AdamW(a.parameters(), **settings), FusedAdamW(b.parameters(), **settings)
    for _ in range(10):
        x = torch.randn(4, 7)
        for model, opt in zip((a, b), optimizers):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6)
    sim = simulate(lambda: tiny_gpt(n_layer=2, d_model=32, n_head=2), "ddp", 2, optimizer=FusedAdamW, progress=False)
    names = [k.name for seg in sim.programs[-1] if getattr(seg, "phase", "") == "optimizer" for k, _ in seg.kernels]
    assert names.count("_fused_adamw_") == 1 and "addcdiv_" not in names
    with pytest.raises(ValueError, match="betas"):
        FusedAdamW(a.parameters(), betas=(0.9, 1.5))


# --- FasterMoE Algorithm 1 and Tutel's adaptive degree, on simulated 64-rank layers -------------------------
def zipf_routing(num_tokens, num_experts, top_k, s=1.2):
    """Simulated counts: every rank routes its tokens by the same Zipf(s) popularity of the experts (expert 0
    the most popular), deterministically, choices of one token distinct."""
    weights = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** s
    cdf = torch.cumsum(weights / weights.sum(), 0)
    u = (torch.arange(num_tokens, dtype=torch.float64) * 0.6180339887) % 1.0
    first = torch.searchsorted(cdf, u).clamp(max=num_experts - 1)
    t = torch.arange(num_tokens)
    return torch.stack([first] + [(first + 1 + (t + j) % (num_experts - 1)) % num_experts for j in range(top_k - 1)], 1)


def moe_block(**options):
    from toolkit.models.presets import moe_gpt_s

    # MoE-GPT-S's width with FasterMoE's alpha = 2 (d_ff = 2H), 64 experts, one block, no token dropped
    return moe_gpt_s(64, n_layer=1, d_ff=2048, moe_options=dict(dropless=True, **options))


def test_fastermoe_ddl_roofline_point_of_a_simulated_configuration():
    """The DDL-roofline (FasterMoE, section 3) from a simulated 64-rank layer's modelled Run, by the same
    recipe as a real run's (`toolkit.viz.roofline_point`: the experts' spans, the all-to-alls' time): the plain
    layer, which computes and communicates in turn, sits on the semi-ideal line P·R/(R+1) (within 5%); the
    pipelined layer (Tutel, degree 4) overlaps them, so it rises above that line, stays under the ideal
    P·min(1, R), and beats the plain layer, although its chunks pay more latency (a lower R_CC)."""
    from toolkit.sim import simulate
    from toolkit.viz.roofline import ideal, roofline_point, semi_ideal

    points = {}
    for label, options in (("plain", {}), ("pipeline 4", {"pipeline_degree": 4})):
        sim = simulate(
            lambda options=options: moe_block(**options),
            "ddp",
            64,
            batch_per_rank=8,
            warmup=False,
            progress=False,
            cluster="dgx-a100",
        )  # fp32: R_CC about 2 on this cluster, where overlap matters
        points[label] = roofline_point(sim.modelled_run, 1024, 2048, label=label)
    plain, piped = points["plain"], points["pipeline 4"]
    assert plain["throughput"] == pytest.approx(semi_ideal(plain["r_cc"], plain["peak"]), rel=0.05)
    assert semi_ideal(piped["r_cc"], piped["peak"]) * 1.1 < piped["throughput"] <= ideal(piped["r_cc"], piped["peak"])
    assert piped["r_cc"] < plain["r_cc"] and piped["throughput"] > plain["throughput"]


def test_fastermoe_algorithm_1_on_simulated_counts_at_64_ranks_and_the_cost_model_agrees():
    """The layer's own Algorithm 1 (shadow="auto") on the counts of a Zipf-skewed routing at 64 ranks, with
    the DGX A100 preset's best GEMM rate as P (267.9 of 312 TFLOP/s bf16) and one NIC (25 GB/s) as W_net: it
    shadows the most loaded experts, heaviest first, exactly as `toolkit.moe.choose_shadows` does on the same
    counts; and the cost model, pricing the programs the strategy really issued, agrees that the step gets faster.
    The paper's "19% of experts shadowed on average" and "up to 1.97x" come from its training runs' loads: not
    reproducible here."""
    from toolkit.moe import choose_shadows
    from toolkit.sim import simulate

    P, W_net = 267.9e12, 25e9
    common = dict(routing=zipf_routing, progress=False, mixed_precision=True, warmup=False, cluster="dgx-a100")
    plain = simulate(lambda: moe_block(), "ddp", 64, **common)
    shadow = simulate(lambda: moe_block(shadow="auto", compute_flops=P, bandwidth=W_net), "ddp", 64, **common)
    record = [m["value"] for m in shadow.run.metrics if m["name"].endswith("/shadow")][-1]
    tokens = shadow.batch_per_rank * shadow.seq_len
    counts = [torch.bincount(zipf_routing(tokens, 64, 2).reshape(-1), minlength=64).tolist()] * 64
    expected = choose_shadows(counts, list(range(64)), H=1024, alpha=2, P=P, W_net=W_net, element_bytes=2)
    assert record["shadowed"] == list(expected.shadowed) and record["shadowed"][:1] == [0]
    loads = [sum(row[e] for row in counts) for e in range(64)]
    assert loads[record["shadowed"][0]] == max(loads)
    assert shadow.step_time < plain.step_time  # the cost model agrees with Algorithm 1's direction
    predicted_gain = record["plain_s"] / record["predicted_s"]
    modelled_gain = plain.step_time / shadow.step_time
    assert predicted_gain > 1 and modelled_gain > 1, (predicted_gain, modelled_gain)


def test_tutel_adaptive_degree_grows_as_the_all_to_all_grows_relative_to_compute():
    """Tutel picks the pipelining degree d in {1, 2, 4, 8} that runs fastest. The simulated layer (64 experts
    on 64 ranks, one per GPU as on Tutel's 2,048-GPU runs; 16K tokens per GPU) is priced on DGX A100 nodes
    whose network goes from 30x faster to 10x slower than HDR, so the all-to-all grows against the experts'
    compute: the best degree is 1 while communication is cheap (more chunks only add latency), and larger
    once it is not. What the model can and cannot give: the trend, yes; degrees 4 and 8 never win here,
    because every chunk's all-to-all pays the latency of 63 messages (Tutel's 2DH all-to-all, which this
    model does not implement, cuts that); nor Tutel's measured 5.75x at 2,048 GPUs (against Fairseq's and
    DeepSpeed's kernels, which are not modelled), nor its run-time choice, which sees real skew and jitter."""
    from toolkit.sim import cluster_of, price, simulate
    from toolkit.sim.hardware import Link

    sims = {
        d: simulate(
            lambda d=d: moe_block(pipeline_degree=d),
            "ddp",
            64,
            batch_per_rank=16,
            progress=False,
            mixed_precision=True,
            warmup=False,
        )
        for d in (1, 2, 4, 8)
    }
    dgx = cluster_of("dgx-a100")
    best = []
    for speed in (30, 3, 1, 0.1):
        net = dgx.with_changes(inter=Link(dgx.inter.bandwidth * speed, dgx.inter.latency))
        times = {d: price(sim, net).step_time for d, sim in sims.items()}
        best.append(min(times, key=times.get))
    assert best == sorted(best), best  # never a smaller degree when communication grows
    assert best[0] == 1 and best[-1] > 1, best


# --- published runs the model was not built against (bench/published_runs.py) -------------------------------------
def published_runs():
    from bench_module import load

    return load("published_runs")


RUNS = published_runs()
RUN_MISSES = {  # run -> what the model predicts when last measured, and what the run paid that it does not price
    "mpt-7b-h100": "13,949 tokens/s per GPU against 10,643 (+31%); " + RUNS.NOTES["mpt-7b-h100"],
    "mcore-1.7b-h100": "500 TFLOP/s per GPU against 408.8 (+22%): " + RUNS.NOTES["mcore-1.7b-h100"],
    "mpt-1b-h100": "62,043 against 45,455 (+36%): " + RUNS.NOTES["mpt-1b-h100"],
    "mpt-13b-h100": "6,464 against 4,792 (+35%): " + RUNS.NOTES["mpt-13b-h100"],
    "llama2-7b-h100": "9,647 against 7,500 (+29%): " + RUNS.NOTES["llama2-7b-h100"],
    "fa2-gpt3-2.7b-h100": "26,504 against 21,873 (+21%): " + RUNS.NOTES["fa2-gpt3-2.7b-h100"],
    "fms-llama-34b-h100": "1,912 against 1,550 (+23%): " + RUNS.NOTES["fms-llama-34b-h100"],
    "fms-llama-70b-h100": "978 against 800 (+22%): " + RUNS.NOTES["fms-llama-70b-h100"],
    "fms-llama-13b-h100": "4,904 against 3,800 (+29%): " + RUNS.NOTES["fms-llama-13b-h100"],
}
SPEEDUP_MISSES = ("mpt-1b", "mpt-7b", "mpt-13b", "llama2-7b", "fa2-gpt3-2.7b", "fms-llama-70b", "fms-llama-13b")
SPEEDUP_MISS = (  # what the pairs' test below measured last
    "predicted H100 over A100 when last measured: MPT-1B 2.63 against the runs' 2.22 (1.19x), MPT-7B 2.65 against "
    "2.29 (1.16x), MPT-13B 2.52 against 2.12 (1.19x), fms-fsdp's Llama 2 7B 2.42 against 2.03 (1.19x), 13B 2.48 "
    "against 2.11 (1.17x), 34B 2.53 against 2.21 (1.14x) and 70B 2.57 against 2.16 (1.19x), flash-attention's "
    "GPT3-2.7B 2.52 against 2.14 (1.18x); " + RUNS.H100_LEVEL
)
MCORE_SIZES = {"mcore-1.7b-h100": 1.7e9, "mcore-7.1b-h100": 7.1e9, "mcore-16b-h100": 16e9}  # the table's column


@pytest.mark.parametrize("name", MCORE_SIZES)
def test_megatron_core_rows_are_the_models_the_table_counts(name):
    """The table's model sizes are untied: 12 L h^2 + 2 V h (plus biases, norms, positions) is 1.75B, 7.12B and
    16.1B (the table's 1.7B, 7.1B, 16B); with the head tied to the embedding they would be 1.48B, 6.58B and 15.3B,
    13%, 7% and 4% under the table's."""
    run = next(r for r in RUNS.RUNS if r.name == name)

    def count(layers, **change):  # a block's parameters are the same in every layer: two depths give the rest
        with torch.device("meta"):
            return GPT(GPTConfig(**dict(run.shape, n_layer=layers, **change))).num_params()

    untied, tied = (
        count(1, **c) + (run.shape["n_layer"] - 1) * (count(2, **c) - count(1, **c)) for c in ({}, {"tied_head": True})
    )
    size = MCORE_SIZES[name]
    assert abs(untied / size - 1) < 0.035 < abs(tied / size - 1), (untied, tied)


def test_megatron_cores_loss_at_tp_1_is_its_vocabulary_parallel_loss_in_fp32():
    """Megatron-Core computes its loss with its vocabulary-parallel cross-entropy at tp 1 too, in fp32 over all
    (tokens x V) logits (the toolkit's tensor-parallel loss): the 1.7B row's model records its fp32 passes over the
    logits (exp, division, product) where the toolkit's GPT records torch's fused bf16 log-softmax."""
    from toolkit.sim import simulate

    shape = dict(vocab_size=512, seq_len=64, n_layer=1, n_head=2, d_model=32, tied_head=False)
    logits = 2 * 64 * 512  # batch 2 x sequence x vocabulary
    found = {}
    for name, model_fn in (
        ("megatron", functools.partial(RUNS.MegatronLossGPT, GPTConfig(**shape))),
        ("gpt", functools.partial(tiny_gpt, **shape)),
    ):
        sim = simulate(model_fn, "zero1", 4, batch_per_rank=2, mixed_precision=True, progress=False, warmup=False)
        kernels = [k for p in sim.programs for c in p if hasattr(c, "kernels") for k, _ in c.kernels]
        found[name] = {(k.name, k.dtype) for k in kernels if k.kind == "other" and k.bytes >= logits * 4}
    assert {("exp", "fp32"), ("div_", "fp32"), ("mul_", "fp32")} <= found["megatron"], found["megatron"]
    assert not any(dtype == "fp32" for _, dtype in found["gpt"]) and ("_log_softmax", "bf16") in found["gpt"]


def test_fms_13b_recomputes_every_second_block():
    """fms-fsdp's 13B row says "Selective AC" and not how selective; its table's MFU and HFU say it. HFU counts the
    recomputed forwards (a third of a step's FLOPs for each block recomputed), MFU does not: recomputing one block in
    k of 40 makes HFU/MFU 1 + 20/40/3 = 1.17 at k = 2, 1.11 at 3, 1.33 at 1 (the 34B and 70B rows, every block:
    1.36 and 1.34). The table's 0.59/0.51 (A100) and 0.40/0.35 (H100), each value rounded to two places, allow k = 2
    alone, what bench/published_runs.py simulates (`activation_checkpointing=2`)."""
    layers = RUNS.FMS_SIZES["13b"][0]["n_layer"]
    published = ((0.51, 0.59), (0.35, 0.40))  # (MFU, HFU): A100, H100
    bounds = [((hfu - 0.005) / (mfu + 0.005), (hfu + 0.005) / (mfu - 0.005)) for mfu, hfu in published]
    allowed = [k for k in range(1, 9) if all(lo <= 1 + layers // k / layers / 3 <= hi for lo, hi in bounds)]
    assert allowed == [2] == [RUNS.FMS_SIZES["13b"][2]["activation_checkpointing"]], allowed


@functools.cache
def predicted_run(name):
    """bench/published_runs.py's prediction of the run called `name`, once a session (the pairs' test reuses it)."""
    return RUNS.predict(next(r for r in RUNS.RUNS if r.name == name))


@pytest.mark.papers  # about a minute a run on 2 cores
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", [r.name for r in RUNS.RUNS])
def test_published_runs_within_15_percent(name):
    """MPT-1B, 7B and 13B (llm-foundry), Llama 2 13B and 70B and Llama 3 8B and 70B (torchtitan), Llama 2 7B, 13B, 34B
    and 70B (fms-fsdp), flash-attention's GPT3-2.7B (Lambda), Megatron-Core's H100 rows and BLOOM-176B, in their
    published layouts, priced from the hardware's measurements. The runs in RUN_MISSES miss 15% and say by how much
    and why; one that comes within fails until it is taken off that list. Each lies inside what every prediction on
    its preset states of its group of runs (`toolkit.sim.held_to_runs`)."""
    run = next(r for r in RUNS.RUNS if r.name == name)
    got = predicted_run(name)
    said = f"{name}: predicted {got['predicted']:.0f} {run.metric}, published {run.measured}"
    # what every prediction on the preset states of these runs (`toolkit.sim.held_to_runs`) holds for this one
    assert held_to_runs.group_of(name, run.cluster).covers(got["error"]), f"{said}: outside what the preset states"
    within = abs(got["error"]) <= RUNS.TOLERANCE
    if name in RUN_MISSES:
        assert not within, said + ": now within 15%; take it off RUN_MISSES"
        pytest.xfail(f"{said} ({RUN_MISSES[name]})")
    assert within, said


@pytest.mark.papers  # two runs of about a minute each on 2 cores (none when the test above ran them)
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("a100, h100", RUNS.PAIRS)
def test_h100_speedup_over_the_a100_is_the_runs(a100, h100):
    """The same code, model and batch on A100s and on H100s (llm-foundry's MPT rows, fms-fsdp's Llama 2 7B, Lambda's
    run of flash-attention's GPT3-2.7B): what the software costs in proportion to the GPU's time cancels in the ratio,
    so the model's H100 rate over its A100 rate is what it says the H100 is worth, held to what the runs measured
    within 15% (the same absolute time on both does not cancel: the test below). One pair is within (fms-fsdp's 34B,
    1.14x); the others miss by 1.16-1.19x (SPEEDUP_MISS), and one that comes within fails until it leaves
    SPEEDUP_MISSES."""
    ((name, (measured, predicted)),) = RUNS.speedups([predicted_run(a100), predicted_run(h100)]).items()
    said = f"{name}: H100 over A100 predicted {predicted:.2f}, measured {measured:.2f} ({predicted / measured:.2f}x)"
    assert measured > 1 and predicted > 1, said  # both sides are the H100's rate over the A100's
    within = abs(predicted / measured - 1) <= RUNS.TOLERANCE
    if name in SPEEDUP_MISSES:
        assert not within, said + ": now within 15%; take it off SPEEDUP_MISSES"
        pytest.xfail(f"{said}: {SPEEDUP_MISS}")
    assert within, said


@pytest.mark.papers  # no run of its own: the rows' predictions are the test's above
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("recomputed", ["llama2-13b-ac2-a100", "llama2-13b-op-a100"])
def test_recomputation_costs_what_torchtitan_measured(recomputed):
    """torchtitan measured the same Llama 2 13B on the same 64 A100s stashing every layer, recomputing every second one
    ("selective layer") and recomputing every layer by operation ("selective op"): 2,162, 1,914 and 1,904 tokens/s per
    GPU, 0.885 and 0.881 of the first. Everything else equal, each ratio is the price of the recomputation alone, which
    the model must give (0.891 and 0.884 when last measured: within 0.7%)."""
    stashed, checkpointed = (predicted_run(name) for name in ("llama2-13b-a100", recomputed))
    measured = checkpointed["run"].measured / stashed["run"].measured
    predicted = checkpointed["predicted"] / stashed["predicted"]
    assert predicted == pytest.approx(measured, rel=0.02), (predicted, measured)


# --- Korthikanti et al. 2022: sequence parallelism and selective recomputation (bench/selective_recompute.py) -------
def selective_recompute():
    from bench_module import load

    return load("selective_recompute")


SELECTIVE = selective_recompute()
KORTHIKANTI = [(name, setting, 1) for name in SELECTIVE.RUNS for setting in SELECTIVE.SETTINGS]
KORTHIKANTI.append((SELECTIVE.DATA_PARALLEL[0], "present work", SELECTIVE.DATA_PARALLEL[1]))


@functools.cache
def korthikanti(name: str, setting: str, dp: int = 1) -> dict:
    r = SELECTIVE.run(name, setting, dp)
    if dp > 1:
        r["published"] = SELECTIVE.DATA_PARALLEL[2]
    return SELECTIVE.predict_run(r)


@pytest.mark.papers  # 20 s (22B) to 6 min (1T) a run on 2 cores
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name, setting, dp", KORTHIKANTI)
def test_korthikantis_runs_within_15_percent(name, setting, dp):
    """The paper's Table 5 (and its 530B at dp 8), each run's seconds a step in its published layout, full
    recomputation without sequence parallelism or sequence parallelism with the core attention recomputed, Megatron's
    backward overlap on: within 15%, inside what the A100 preset states of its runs (`held_to_runs`)."""
    got = korthikanti(name, setting, dp)
    said = f"{name} at dp {dp}, {setting}: predicted {got['step_time']:.2f} s, published {got['published']} s"
    assert abs(got["error"]) <= SELECTIVE.TOLERANCE, said
    assert held_to_runs.group_of(SELECTIVE.run_name(name, setting, dp), "dgx-a100").covers(got["error"]), said


@pytest.mark.papers  # no run of its own: the runs' predictions are the test's above
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", SELECTIVE.RUNS)
def test_what_selective_recomputation_and_sequence_parallelism_gain_is_the_papers(name):
    """The same model and layout both ways: the step of full recomputation over that of the paper's method is the
    price of recomputing whole layers without sequence parallelism alone, 29.0% to 32.1% published; predicted within
    5 points."""
    full, present = (korthikanti(name, setting, 1) for setting in SELECTIVE.SETTINGS)  # the cache's keys
    published = full["published"] / present["published"] - 1
    predicted = full["step_time"] / present["step_time"] - 1
    assert predicted == pytest.approx(published, abs=0.05), (name, predicted, published)


@pytest.mark.papers  # ten simulations of three and four of the 22B's layers, about a minute on 2 cores
@pytest.mark.timeout(1800)
def test_one_layer_recomputed_whole_or_its_attention_costs_what_the_paper_measured():
    """Table 4: one layer of the 22B, forward and backward. Over the layer that stores everything, recomputing it
    whole costs 39% measured and recomputing its core attention 7%; predicted within 5 points each."""
    times = {name: sum(SELECTIVE.layer_times(options)) for name, (options, _) in SELECTIVE.LAYER.items()}
    published = {name: sum(ms) for name, (_, ms) in SELECTIVE.LAYER.items()}
    base = "baseline, no recompute"
    for name in ("full recompute", "selective recompute"):
        predicted, measured = times[name] / times[base] - 1, published[name] / published[base] - 1
        assert predicted == pytest.approx(measured, abs=0.05), (name, predicted, measured)


@pytest.mark.papers  # six simulations of three and four of the 22B's layers, under a minute on 2 cores
@pytest.mark.timeout(1800)
def test_one_layer_under_sequence_parallelism_is_the_papers_as_megatron_lays_it_out():
    """Table 4: with sequence parallelism the layer ran 3% faster than the layer that stores everything, and 4% slower
    with its core attention recomputed too. The toolkit's activations are batch-first, (b, s, h): each all-gather along
    the sequence ends in a copy, each reduce-scatter starts with one and each all-reduce sums a clone, ten copies of
    b·s·h a layer under sequence parallelism and four without, where Megatron's, sequence-first, gather and scatter
    whole rows and sum in place. Priced without them (`as_megatron_lays_out`), both overheads are within 5 points of
    the paper's; the toolkit's layer is slower by those copies at the A100's streaming bandwidth, and nothing else."""
    from toolkit.sim.hardware import cluster_of
    from toolkit.sim.kernel_time import hbm_bandwidth

    settings = ("baseline, no recompute", "sequence parallelism", "selective + sequence")
    ours, megatron = ({n: sum(SELECTIVE.layer_times(SELECTIVE.LAYER[n][0], lay)) for n in settings} for lay in (0, 1))
    published = {n: sum(SELECTIVE.LAYER[n][1]) for n in settings}
    base = settings[0]
    for name in settings[1:]:
        predicted, measured = megatron[name] / megatron[base] - 1, published[name] / published[base] - 1
        assert predicted == pytest.approx(measured, abs=0.05), (name, predicted, measured)
    hidden, micro_batch = SELECTIVE.RUNS["22B"][0][2], SELECTIVE.RUNS["22B"][1]
    copy = 2 * micro_batch * 2048 * hidden * 2 / hbm_bandwidth(cluster_of("dgx-a100").gpu)  # read and write, bf16
    for name, copies in ((base, 4), ("sequence parallelism", 10)):
        assert ours[name] - megatron[name] == pytest.approx(copies * copy, rel=0.05), name


def test_megatrons_layout_is_priced_on_the_simulators_tensors_only():
    """`as_megatron_lays_out` swaps the toolkit's three collectives for views wherever they are held, refuses a real
    tensor (its views would put the wrong rows in place), and puts the toolkit's back on leaving."""
    from toolkit.parallel.tensor import operators, overlap, sequence

    def holders():
        return operators.all_gather, sequence.all_gather, sequence.reduce_scatter, overlap.all_reduce

    toolkits = holders()
    with SELECTIVE.as_megatron_lays_out():
        assert all(view is not held for view, held in zip(holders(), toolkits))
        with pytest.raises(RuntimeError, match="meta tensors"):
            sequence.all_gather(torch.ones(2, 4, 8), None, 1, "a real tensor")
    assert holders() == toolkits


@pytest.mark.papers  # no run of its own: the pairs' predictions are the tests' above
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("a100, h100", RUNS.PAIRS)
def test_h100_row_paying_the_time_its_a100_twin_left_unpriced(a100, h100):
    """What the ratio above hides: each run's time a token and GPU beyond its compute as priced
    (bench/published_pairs.py), in absolute time, is about the same on both GPUs of a pair. The H100 row priced
    with its A100 twin's time on top comes within 15% in every pair (-3% to +13% when last measured;
    docs/differences.md, "The H100 gap"): the steps' kernels ran slower than their benchmarks by about the same
    time per unit of work on both GPUs, a larger share of the H100's shorter step."""
    ((name, (a100_us, h100_us, carried)),) = RUNS.unpriced([predicted_run(a100), predicted_run(h100)]).items()
    said = f"{name}: {a100_us:.1f} µs a token beyond the priced compute on A100, {h100_us:.1f} on H100"
    assert a100_us > 0 and h100_us > 0, said  # the model prices each run faster than it ran
    assert abs(carried) <= RUNS.TOLERANCE, f"{said}: the H100 row with the A100's time is {carried:+.0%}"


# --- Llama 3 405B's 128k layout on 16,384 H100 (bench/long_context.py) -------------------------------------------
def long_context():
    from bench_module import load

    return load("long_context")


LONG = long_context()
LLAMA3_WHY = (
    "the stand-in pays what Llama 3 did not (docs/differences.md, 'The simulator held to published runs at scale'): "
    "the pipeline's bubble (14-49% of the step, where the formula gives 10.5-48%), activation checkpointing, without "
    "which its first stage does not fit, and virtual stages the paper does not give; not cp's bytes (the ring passes "
    "the 8 key-value heads' K and V, what Llama 3's all-gather moves)"
)


@pytest.mark.papers  # 30 s to 3 min a schedule on 2 cores (three kinds of stage, 16 micro-batches, 16,384 ranks)
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("virtual", LONG.VIRTUAL)
def test_llama3_405b_128k_layout_at_16384_gpus(virtual):
    """Llama 3's 128k stage (Table 4: tp 8, cp 16, pp 16, dp 8 on 16,384 H100, 380 TFLOP/s per GPU in PaLM's count)
    simulated at its own world size and priced: it fits, the stand-in is never faster than the run (it
    recomputes its activations), and within 15% at 8 virtual stages alone (195 / 253 / 297 / 324 TFLOP/s per GPU
    at 1 / 2 / 4 / 8 virtual stages when last measured, the ring passing grouped-query K and V; -49% / -33% / -22% /
    -15%)."""
    got = LONG.llama3(virtual, "ring")
    assert got["fits"] and got["predicted"] < LONG.LLAMA3["measured"]
    said = f"{virtual} virtual stages: predicted {got['predicted']:.0f} TFLOP/s per GPU, published 380"
    if abs(got["error"]) > LONG.TOLERANCE:
        pytest.xfail(f"{said} ({got['error']:+.0%}): {LLAMA3_WHY}")
