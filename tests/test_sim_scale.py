"""At cluster scale: the papers' models and cluster sizes, simulated with the strategies' own code.

Meta tensors cost the same whatever their size, so the full widths are used (d_model 12288 for GPT-3);
the layer count is cut to 2, which keeps every formula exact (model states and bytes are linear in
the parameter count, and the parameter count is the model's own). `bench/sim_speed.py` runs the
full-depth models.
"""

from __future__ import annotations

import math

import pytest

from toolkit.memory import formulas, model_states
from toolkit.models import presets
from toolkit.sim import simulate

GB = 1e9
MIXED = dict(mixed_precision=True)


def test_zero_figure_1_from_the_strategies_own_tensors():
    """ZeRO Figure 1: model states per rank of a 7.5B model at 64 ranks, (2+2+12)Ψ by stage."""
    paper = {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}  # GB, for Ψ = 7.5B
    full = 7_489_089_536  # the preset's parameters (36 layers), counted on meta in test_presets_are_the_papers
    for strategy, stage in (("ddp", 0), ("zero1", 1), ("zero2", 2), ("zero3", 3)):
        sim = simulate(lambda: presets.zero_7_5b(n_layer=2), strategy, 64, progress=False, **MIXED)
        expected = model_states(sim.num_params, 64, stage)
        padding = 16 * 63 * (3 if stage < 3 else 20)  # < N elements per flat buffer, 16 bytes each
        assert expected <= sim.memory["total"] <= expected + padding + 4 * 40, strategy  # + Adam's step counters
        assert float(f"{model_states(full, 64, stage) / GB:.3g}") == pytest.approx(paper[stage], abs=0.051)


@pytest.mark.parametrize("strategy, options", [("zero3", {}), ("fsdp", {}), ("fsdp", {"sharding_group_size": 8})])
def test_gpt3_175b_on_512_ranks(strategy, options):
    W, G = 512, 8
    sim = simulate(lambda: presets.gpt3_175b(n_layer=2), strategy, W, progress=False, **MIXED, **options)
    psi = sim.num_params
    F = options.get("sharding_group_size", W)
    units = 20 if strategy == "zero3" else 3
    assert 16 * psi / F <= sim.memory["total"] <= 16 * (psi / F + units * F)  # (2+2+12)Ψ/F within padding
    M = 2 * psi  # the model in 16-bit values
    gathers = 2 * M * (F - 1) / F  # forward and backward all-gathers, then a reduce-scatter
    rings = 3 * M * (F - 1) / F
    if F == W:  # full sharding: every byte crosses nodes, 3M(W-1)/W (the FSDP paper)
        assert rings <= sim.bytes_per_step["total"] <= rings + 3 * 2 * units * W
        assert sim.cross_node_bytes == sim.bytes_per_step["total"]
        assert sim.cross_node_bytes == pytest.approx(formulas.fsdp_cross_host_traffic(M, G, W, "full_shard"), rel=1e-6)
    else:  # hybrid: shard inside a node, all-reduce the shard across nodes; only that leaves the node
        assert gathers + M * (F - 1) / F <= sim.bytes_per_step["total"] - sim.cross_node_bytes
        exact = 2 * M * (W - G) / (G * W)  # a ring all-reduce of the M/G shard over the W/G replicas
        assert exact <= sim.cross_node_bytes <= exact + 2 * 2 * units * G
        paper = formulas.fsdp_cross_host_traffic(M, G, W, "hybrid")  # 2M(W-1)/(GW)
        assert sim.cross_node_bytes == pytest.approx(paper, rel=(G - 1) / (W - 1))
        assert sim.cross_node_bytes < formulas.fsdp_cross_host_traffic(M, G, W, "full_shard") / 10


def test_fsdp_peak_is_the_shards_plus_the_units_in_flight():
    """Peak parameter memory Σψ/F + max ψ (FSDP paper): in backward the unit computing, the next one
    prefetched, and the root (embeddings and head, which backward needs first and last)."""
    W = 512
    sim = simulate(lambda: presets.gpt3_175b(n_layer=4), "fsdp", W, progress=False, **MIXED)
    assert sim.peak_moment["pass"] == "backward"
    block = 12 * 12288**2 + 13 * 12288
    root = sim.num_params - 4 * block
    padded = lambda n: n + (-n) % W  # noqa: E731
    assert sim.peak_memory["gathered"] == 2 * (2 * padded(block) + padded(root))  # bf16 gathered units
    shards = sim.peak_memory["params"] / 4  # the fp32 shards, in elements
    in_flight = sim.peak_memory["gathered"] / 2
    sizes = [root] + [block] * 4
    assert formulas.fsdp_peak_params(sizes, W, in_flight=2) <= shards + in_flight
    assert shards + in_flight <= formulas.fsdp_peak_params(sizes, W, in_flight=3) + 5 * W


def test_moe_64_experts_on_64_ranks():
    """Expert parallelism: each rank holds 1/64 of the experts; every MoE layer's dispatch and combine
    all-to-alls (forward and backward) carry capacity x experts x d_model values, (W-1)/W of them sent."""
    W, E, k, d = 64, 64, 2, 1024
    sim = simulate(lambda: presets.moe_gpt_64(n_layer=2, capacity_factor=1.0), "ddp", W, progress=False)
    assert sim.local_expert_params * W == sim.expert_params
    T = sim.batch_per_rank * sim.seq_len
    C = math.ceil(k * 1.0 * T / E)
    exchanges = [c for c in sim.collectives() if c.op == "all_to_all" and c.label != "counts"]
    assert sorted(c.label for c in exchanges) == sorted(
        ["dispatch", "combine", "dispatch backward", "combine backward"] * 2
    )
    for c in exchanges:
        assert c.size_bytes == E * C * d * 4  # balanced routing fills every expert's capacity exactly
        assert c.bytes_sent == c.size_bytes * (W - 1) // W
    expert_bytes = 4 * sim.local_expert_params
    assert sim.memory["params"] == 4 * (sim.num_params - sim.expert_params) + expert_bytes


@pytest.mark.parametrize("world", [32, 64])
def test_moe_with_more_ranks_than_experts_simulates(world):
    """16 experts on 32 and 64 ranks: each expert sliced over W/E ranks (Tutel's EP+DP+MP). The simulated rank
    runs the sliced path on meta tensors (it once crashed in index_add: a CPU index into a meta tensor), counts
    every expert once whatever the layout, and holds 1/W of the experts' weights (their output bias slices
    padded to whole elements)."""
    with __import__("torch").device("meta"):
        whole = sum(p.numel() for p in presets.moe_gpt_s(n_layer=1).parameters())
    sims = {w: simulate(lambda: presets.moe_gpt_s(n_layer=1), "ddp", w, progress=False, **MIXED) for w in (16, world)}
    sliced = sims[world]
    assert sliced.num_params == sims[16].num_params == whole
    assert sliced.expert_params == sims[16].expert_params
    s, d = world // 16, 1024
    assert sliced.expert_params // world <= sliced.local_expert_params <= sliced.expert_params // world + d % s + s
    exchanges = [c for c in sliced.collectives() if c.op == "all_to_all" and c.label != "counts"]
    assert sorted({c.label for c in exchanges}) == ["combine", "combine backward", "dispatch", "dispatch backward"]
    assert sliced.flops == pytest.approx(
        sims[16].flops, rel=1e-9
    )  # the same rows, each through 1/s of an expert s times


def test_presets_are_the_papers():
    import torch

    with torch.device("meta"):
        assert sum(p.numel() for p in presets.zero_7_5b().parameters()) == 7_489_089_536
        moe = presets.moe_gpt_s()
    H, L, E, alpha = 1024, 12, 16, 2  # FasterMoE Table 2: L(2αE + 4)H² = 0.86B without embeddings and biases
    weights = [(n, p) for n, p in moe.named_parameters() if n.endswith(("qkv.weight", "proj.weight", "w1", "w2"))]
    body = sum(p.numel() for n, p in weights if "mlp.proj" not in n)
    assert body == L * (2 * alpha * E + 4) * H * H
    gpt3 = presets.GPT3
    d, layers = gpt3["d_model"], gpt3["n_layer"]
    psi = layers * (12 * d * d + 13 * d) + (gpt3["vocab_size"] + gpt3["seq_len"]) * d + 2 * d
    assert psi == 174_604_259_328  # GPT-3 "175B"


@pytest.mark.large_world  # two simulations of a 16-stage pipeline, about 30 s on 2 cores
@pytest.mark.timeout(600)
def test_a_rank_of_16384_runs_the_program_of_the_same_rank_at_4096():
    """Llama 3's 128k layout (tp 8, cp 16, pp 16, dp 8 on 16,384 GPUs, ordered tp-cp-pp-dp) is past the 4,096 ranks
    the simulator once stopped at. One rank's program depends on its groups, not on the world: at 16,384 (dp 8) and
    at 4,096 (dp 2) rank 0 runs the same operations, holds the same memory and sends the same messages to the same
    tp, cp and pp peers; only the group its gradients are reduced over (dp x cp) is wider, 128 members where the
    layout puts them (rank tp + 8 cp + 128 pp + 2,048 dp), and with it the ring's share of each all-reduce,
    2(n-1)/n."""
    from toolkit.models import tiny_gpt
    from toolkit.parallel.mesh import Layout
    from toolkit.sim.cluster import MAX_WORLD_SIZE, check

    shape = dict(tp=8, cp=16, pp=16, order="tp-cp-pp-dp", sequence_parallel=True)
    sims = {
        world: simulate(
            lambda: tiny_gpt(n_layer=16, d_model=64, n_head=8, seq_len=512, vocab_size=256),
            "ddp",
            world,
            batch_per_rank=16,
            progress=False,
            **MIXED,
            **shape,
        )
        for world in (4096, 16384)
    }
    small, large = sims[4096], sims[16384]
    assert large.peak == small.peak and large.peak_memory == small.peak_memory and large.flops == small.flops
    layout = Layout(dp=8, pp=16, cp=16, tp=8, order="tp-cp-pp-dp")
    assert layout.group_of(0, "dp") == list(range(0, 16384, 2048))
    dp_group = sorted(d + c for d in layout.group_of(0, "dp") for c in layout.group_of(0, "cp"))
    ops = {world: [(c.op, c.size_bytes, c.group) for c in sim.collectives()] for world, sim in sims.items()}
    assert len(ops[4096]) == len(ops[16384]) > 0
    for (op, size, group), (op_, size_, group_) in zip(ops[4096], ops[16384]):
        assert (op, size) == (op_, size_)
        assert group == group_ or (len(group), len(group_)) == (32, 128) and sorted(group_) == dp_group
    reduced = [c for c in large.collectives() if c.op == "all_reduce" and sorted(c.group) == dp_group]
    assert reduced and all(c.bytes_sent == 2 * 127 * c.size_bytes // 128 for c in reduced)
    assert MAX_WORLD_SIZE == 65536
    with pytest.raises(ValueError, match="1 to 65536"):
        check(65537)
