"""Which labels `python -m toolkit compare` trains, and how: the same model, seed and global batch for each.

A label is a strategy of `toolkit.parallel.STRATEGIES`, or one of two more: "hsdp" (fsdp with units sharded
within pairs of ranks) and "moe-ep" (the MoE-GPT, experts split over the ranks, DDP on the dense part).
`plan` turns a label into the TrainConfig, model and number of ranks it trains with.
"""

from __future__ import annotations

from . import parallel
from .compare_theory import HSDP_GROUP, MODEL, MOE
from .models import tiny_gpt
from .train import TrainConfig, moe_model_fn

MOE_LABEL = "moe-ep"
HSDP_LABEL = "hsdp"  # strategy fsdp with sharding_group_size=HSDP_GROUP
DEFAULT_STRATEGIES = ("local", "dp", "ddp", "zero1", "zero2", "zero3", "fsdp", HSDP_LABEL, MOE_LABEL)
# Strategy options for a model this small: DDP's default 25 MB bucket would hold the whole model,
# leaving nothing to overlap; a quarter of the gradient bytes gives four buckets.
STRATEGY_OPTIONS = {"ddp": lambda grad_bytes: {"bucket_cap_mb": grad_bytes / 4 / 2**20}}


def available_strategies(wanted=DEFAULT_STRATEGIES) -> list[str]:
    """The wanted strategies whose implementation exists in this checkout."""
    import importlib

    out = []
    for name in wanted:
        module, _ = (
            ("toolkit.moe.layer", None)
            if name == MOE_LABEL
            else parallel.STRATEGIES["fsdp" if name == HSDP_LABEL else name]
        )
        try:
            importlib.import_module(module)
        except ModuleNotFoundError:
            continue
        out.append(name)
    return out


def plan(name: str, world_size: int, steps: int, mixed_precision: bool = False):
    """How a label trains: (TrainConfig, model_fn or None, ranks). The same model, seed and global batch
    for every label; "local" on one rank, the others on `world_size`."""
    num_params = tiny_gpt(**MODEL).num_params()
    strategy = {MOE_LABEL: MOE["strategy"], HSDP_LABEL: "fsdp"}.get(name, name)
    extra = STRATEGY_OPTIONS.get(strategy, lambda _: {})(num_params * (2 if mixed_precision else 4))
    if name == HSDP_LABEL:
        extra = dict(extra, sharding_group_size=HSDP_GROUP)
    options = dict({"mixed_precision": True} if mixed_precision else {}, **extra)
    config = TrainConfig(
        strategy=strategy,
        steps=steps,
        global_batch_size=4 * world_size,
        model=dict(MODEL),
        options=options,
        progress=False,
    )
    model_fn = moe_model_fn(MOE["experts_per_rank"] * world_size, MOE["top_k"]) if name == MOE_LABEL else None
    return config, model_fn, 1 if name == "local" else world_size
