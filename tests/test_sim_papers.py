"""The papers' numbers as expected values: FasterMoE's Table 2 from the toolkit's MoE models built on meta,
its DDL-roofline and Algorithm 1 on the cost model, Tutel's adaptive pipelining degree, and the FSDP
paper's GPT-175B throughput and full-versus-hybrid trend, predicted by the simulator and the cost model.
Each test states its tolerance and what the model cannot reproduce."""
import pytest
import torch

from toolkit.models.moe_gpt import moe_gpt
from toolkit.moe.experts import Experts

# --- FasterMoE Table 2: parameters = L (2 alpha E + 4) H^2 --------------------------------------------------
TABLE_2 = {  # name -> (size in the paper, layers, experts, H); alpha = 2 for every model
    "MoE-GPT-S": (0.86e9, 12, 16, 1024), "MoE-GPT": (3.42e9, 12, 16, 2048), "MoE-GPT-L": (13.7e9, 12, 16, 4096),
    "MoE-BERT-Deep": (1.71e9, 24, 16, 1024), "MoE-BERT-Deep-L": (27.4e9, 24, 16, 4096),
    "MoE-BERT-Wide": (3.27e9, 12, 64, 1024), "MoE-BERT-Wide-L": (13.1e9, 12, 64, 2048),
}


@pytest.mark.parametrize("name", TABLE_2)
def test_fastermoe_table_2_parameter_counts_from_the_real_models_built_on_meta(name, monkeypatch):
    """The table counts the weight matrices of attention (4H^2) and of the experts (2 alpha H^2 each):
    exactly L (2 alpha E + 4) H^2 in the model the toolkit builds, and that rounds to the paper's size
    (3 significant digits). Embeddings, biases, norms and routers come on top (reported, not in the table)."""
    size, layers, experts, H = TABLE_2[name]
    alpha = 2
    monkeypatch.setattr(Experts, "reset_parameters", lambda self, init_std=0.02: None)  # no values on meta
    with torch.device("meta"):
        model = moe_gpt(experts, 2, n_layer=layers, d_model=H, n_head=16, d_ff=alpha * H, vocab_size=50257, seq_len=1024)
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
# latencies. Its configuration: full sharding, bf16, activation checkpointing, backward prefetch, and
# forward prefetch (torch FSDP's CPU runs ahead and issues the next unit's all-gather early; the
# toolkit's FSDP does that only when asked, forward_prefetch=True), a batch of 1 sequence of 2048 per GPU.
PAPER_TFLOPS = (173, 186)
TOLERANCE = 0.15


def fsdp_paper_cluster():
    from toolkit.sim import cluster_of

    return cluster_of(dict(name="fsdp-paper", gpu="a100-80gb", gpus_per_node=8, intra=("300 GB/s", "3.4 us"),
                           inter=("250 Gb/s", "9.6 us"), call_latency="8.4 us", source="FSDP paper, section 6"))


def gpt3_fsdp(world, layers=96, **options):
    from toolkit.models.presets import gpt3_175b
    from toolkit.sim import simulate

    return simulate(lambda: gpt3_175b(n_layer=layers), "fsdp", world, batch_per_rank=1, mixed_precision=True,
                    activation_checkpointing=True, forward_prefetch=True, warmup=False, progress=False,
                    cluster=fsdp_paper_cluster(), **options)


def assert_in_papers_band(sim):
    low, high = PAPER_TFLOPS[0] * (1 - TOLERANCE), PAPER_TFLOPS[1] * (1 + TOLERANCE)
    assert low <= sim.tflops_per_gpu <= high, (f"{sim.world_size} GPUs: {sim.tflops_per_gpu:.1f} TFLOP/s per GPU, "
                                               f"paper {PAPER_TFLOPS}, tolerance {TOLERANCE:.0%}")


def test_fsdp_paper_gpt_175b_throughput_and_hybrid_sharding_on_8_of_its_layers():
    """8 of GPT-3's 96 layers (same width, heads and sequence; the embedding and head as in the full model):
    per-GPU throughput is the ratio of a layer's compute to the communication it cannot hide, so it lands
    in the paper's band (173-186 TFLOP/s within 15%), flat from 128 to 512 GPUs as the paper's scaling is.
    (The whole 96-layer model: the slow test below.)

    What the model can and cannot reproduce of full against hybrid sharding: hybrid sharding sends 2/3 of
    full sharding's bytes across nodes per GPU (the paper's 2M(W-1)/(GW) against 3M(W-1)/W, both at the
    node's cards), which the cost model shows; but the toolkit's HSDP waits for each replica all-reduce as
    soon as it issues it (fsdp_unit's finish), so that all-reduce is exposed, and the prediction says so:
    hybrid's exposed communication is its all-reduces' time. torch FSDP runs it on its reduce-scatter
    stream instead, which is why the paper sees hybrid sharding win on slow networks."""
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
    assert bandwidth_time(replica) / bandwidth_time(full) == pytest.approx(2 / 3, rel=0.03)
    hybrid_cross = sum(s.end - s.start for s in replica)
    exposed_replica = sum(w.end - w.start for w in hybrid.cost.timelines[-1].spans if w.kind == "wait"
                          and w.instruction.id in {s.instruction.id for s in replica})
    assert exposed_replica == pytest.approx(hybrid_cross, rel=0.05)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp_paper_gpt_175b_whole_model_on_128_256_512_gpus():
    for world in (128, 256, 512):
        assert_in_papers_band(gpt3_fsdp(world))
