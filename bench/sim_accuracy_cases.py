"""What bench/sim_accuracy.py predicts and measures: the same cases on both sides.

The tiny GPT and its strategies (`CONFIGS`: data parallelism, ZeRO 1-3, FSDP with and without prefetch, and a
replica split by tensor or pipeline parallelism), and the MoE layer on an emulated link (`MOE`, `MOE_VARIANTS`:
plain, pipelined, shadowing) with one fixed skewed routing (`skewed`), so that the real and the simulated
layer route every token alike.
"""

from __future__ import annotations

import torch

MODEL = dict(n_layer=4, d_model=128, n_head=4, vocab_size=256, seq_len=64)
PER_RANK_BATCH = 8
CONFIGS = {  # name -> (strategy, options)
    "ddp": ("ddp", {}),
    "zero1": ("zero1", {}),
    "zero2": ("zero2", {}),
    "zero3": ("zero3", {}),
    "zero3 buckets": ("zero3", dict(prefetch_bucket_size=200_000, reduce_bucket_size=200_000)),
    "fsdp prefetch": ("fsdp", dict(forward_prefetch=True, backward_prefetch=True)),
    "fsdp no prefetch": ("fsdp", dict(forward_prefetch=False, backward_prefetch=False)),
    "ddp x tp 2": ("ddp", dict(tp=2)),  # the replica's 8 sequences, each layer split over 2 ranks
    "ddp x pp 2": ("ddp", dict(pp=2, microbatches=4)),  # the replica's 8 sequences, 1F1B over 2 stages
}
MOE = dict(
    d_model=128,
    d_ff=512,
    experts_per_rank=2,
    vocab=64,
    batch=8,
    seq_len=64,
    top_k=2,
    bandwidth="20 MB/s",
    latency="0.5 ms",
)
MOE_VARIANTS = {"moe plain": {}, "moe pipeline 4": dict(pipeline_degree=4), "moe shadow": dict(shadow=[0])}


def moe_block(world: int, **options):
    """The MoE case: a one-block GPT whose MLP is the MoE layer, experts over all ranks (`toolkit.models.moe_gpt`)."""
    from toolkit.models.moe_gpt import moe_gpt

    return moe_gpt(
        MOE["experts_per_rank"] * world,
        MOE["top_k"],
        n_layer=1,
        d_model=MOE["d_model"],
        n_head=4,
        d_ff=MOE["d_ff"],
        vocab_size=MOE["vocab"],
        seq_len=MOE["seq_len"],
        moe_options=options,
    )


def skewed(num_tokens: int, num_experts: int, top_k: int) -> torch.Tensor:
    """A fixed skewed routing, the same for the real and the simulated layer: half the tokens pick expert 0
    first, the others spread; the second choice is another expert."""
    t = torch.arange(num_tokens, device="cpu")
    first = torch.where(t % 4 < 2, torch.zeros_like(t), t % num_experts)
    choices = [first] + [(first + 1 + (t + j) % (num_experts - 1)) % num_experts for j in range(top_k - 1)]
    return torch.stack(choices, dim=1)
