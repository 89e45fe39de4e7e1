"""What each row of `python -m toolkit compare` should cost by the formulas: model states per rank (ZeRO's
(2 + 2 + K)Ψ/N terms, or fp32 AdamW's 4 + 4 + 8), and bytes sent per step, for the strategies the ZeRO
formulas describe, for hybrid sharding ("hsdp") and for the expert-parallel MoE-GPT ("moe-ep")."""

from __future__ import annotations

from .memory import communication_per_step, model_states
from .train import TrainConfig

ZERO_STAGE = {"local": 0, "dp": 0, "ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}
MODEL = dict(n_layer=2, d_model=64, n_head=4)  # the tiny GPT every row trains
MOE = dict(strategy="ddp", experts_per_rank=2, top_k=2)  # how "moe-ep" trains the MoE-GPT
HSDP_GROUP = 2  # "hsdp": units sharded within pairs of ranks, replicated across the pairs


def predicted_model_states(num_params: int, world: int, strategy: str, mixed_precision: bool) -> float:
    """The formula's bytes per rank for params + grads + optimizer under this strategy.

    fp32 AdamW: 4 + 4 + 8 bytes per parameter (no separate master copy); mixed precision: 2 + 2 + 12.
    """
    if mixed_precision:
        return model_states(num_params, world, ZERO_STAGE[strategy])
    return model_states(num_params, world, ZERO_STAGE[strategy], param_bytes=4, grad_bytes=4, optimizer_multiplier=8)


def moe_theory(world: int, config: TrainConfig, mixed_precision: bool) -> dict:
    """What "moe-ep" should cost per rank: model states of the dense parameters plus this rank's experts,
    and bytes sent per step: DDP's all-reduce of the dense gradients plus, per MoE layer, the count
    exchange and four all-to-alls of token rows (dispatch, combine, and both again in backward),
    each sending the (W-1)/W of a rank's T*k rows that belong to other ranks' experts (balanced
    routing, nothing dropped)."""
    from .models import moe_gpt
    from .moe import is_expert

    E, k = MOE["experts_per_rank"] * world, MOE["top_k"]
    model = moe_gpt(E, k, **MODEL)
    experts = sum(p.numel() for p in model.parameters() if is_expert(p))
    dense = model.num_params() - experts
    layers = MODEL["n_layer"]
    tokens = config.global_batch_size // world * config.seq_len
    element = 2 if mixed_precision else 4
    rows = 4 * layers * tokens * k * (world - 1) / world * MODEL["d_model"] * element
    counts = layers * E * (world - 1) / world * 8
    return {
        "num_params": dense + experts,
        "dense": dense,
        "experts": experts,
        "experts_per_rank": experts // world,
        "states": predicted_model_states(dense + experts // world, world, "ddp", mixed_precision),
        "sent": communication_per_step(dense, world, "ddp") * element + rows + counts,
        "rows": rows,
        "row_bytes": MODEL["d_model"] * element,
        "experts_per_rank_per_layer": MOE["experts_per_rank"],
    }


def hsdp_theory(num_params: int, world: int, mixed_precision: bool) -> dict:
    """What "hsdp" should cost per rank: ZeRO-3's model states over the F ranks of a shard group, and bytes
    sent per step: 3Ψ(F-1)/F within the group (two all-gathers, one reduce-scatter) plus the all-reduce of
    the Ψ/F gradient slice across the R = W/F replicas, 2(Ψ/F)(R-1)/R."""
    F, R = HSDP_GROUP, world // HSDP_GROUP
    element = 2 if mixed_precision else 4
    sent = communication_per_step(num_params, F, "fsdp") + 2 * (num_params / F) * (R - 1) / R
    return {"states": predicted_model_states(num_params, F, "fsdp", mixed_precision), "sent": sent * element}
