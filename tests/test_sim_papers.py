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
