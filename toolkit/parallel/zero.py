"""ZeRO: data parallelism without the redundancy, in three stages.

Plain data parallelism keeps on every rank the parameters (P), their gradients (G) and the optimizer
states (O): (2 + 2 + K)Ψ bytes for Ψ parameters (K = 12 for mixed-precision Adam: fp32 master,
momentum, variance). ZeRO partitions them over the N ranks, one more kind per stage:

    stage 1  optimizer states   P + G + O/N     each rank steps only its slice of the parameters
    stage 2  + gradients        P + (G + O)/N   each rank keeps only its slice of the gradients
    stage 3  + parameters       (P + G + O)/N   each rank stores only its slice of the parameters

Every rank owns the same slice r of every flat buffer (`flat.py`) and updates it with an ordinary
optimizer (`sharded_optimizer.py`). What changes between stages is which collective runs when
(stages 1 and 2: `zero12.py`; stage 3: `zero3.py`):

ZeRO-1  forward with full parameters -> backward fills full gradients -> when backward is over,
        reduce-scatter them (rank r receives the average of slice r) -> the optimizer steps slice r
        in fp32 -> all-gather the updated slices back into the full parameters.
ZeRO-2  as ZeRO-1, but each bucket of gradients is reduce-scattered *during* backward, as soon as it
        is complete, and its full gradients are freed at once: only the slice stays.
ZeRO-3  parameters live as slices only: all-gathered just before a module's forward and freed right
        after, gathered again for its backward, then its gradients are reduce-scattered into the
        owners' slices. Three passes over Ψ per step instead of two (see `zero3.py`).

Options (every stage):
  mixed_precision  False (fp32), True (bfloat16) or a 16-bit dtype: 16-bit parameters and gradients
                   for compute and communication, fp32 master weights and fp32 optimizer states
                   (2 + 2 + 12 bytes per parameter), as in "local" and "ddp". ZeRO-1 and ZeRO-2 also take
                   `MixedPrecision(param_dtype, reduce_dtype)` (or its dict) as FSDP does: reduce_dtype=torch.float32
                   adds each backward's 16-bit gradients into fp32 buffers and reduces those (Megatron-LM's main
                   gradients, `--accumulate-allreduce-grads-in-fp32`; DeepSpeed's BF16_Optimizer): 4 bytes of
                   gradient per parameter where there were 2, and twice the reduction's bytes.
  group            the process group to shard over (default: every rank).
ZeRO-1 and ZeRO-2:
  bucket_cap_mb    MiB of gradients per bucket (25, as DDP): the unit of a reduce-scatter.
ZeRO-3:
  prefetch_bucket_size, reduce_bucket_size   elements per all-gather / reduce-scatter (DeepSpeed's
                   names), 0 by default: one module at a time. See `zero3.py`.
  sub_group_size   elements the optimizer steps at once (DeepSpeed's name), 0 by default: one module's
                   slice at a time, so that only its gradient exists in fp32 (mixed precision). See `zero3.py`.
ZeRO-1:
  reduce           "reduce_scatter" (default), or "all_reduce": every rank receives the whole averaged
                   gradient and uses only its slice. Same result, DDP's traffic plus the all-gather
                   (3Ψ instead of 2Ψ): the notebook's contrast for why a reduce-scatter is enough.
  overlap_grad_reduce   False; True: each bucket reduced during backward, as soon as it is complete (Megatron-LM's
                   distributed optimizer, `--overlap-grad-reduce`). See `zero12.py`.
ZeRO-1 and ZeRO-2:
  overlap_param_gather  False; True: the updated parameters all-gathered bucket by bucket when the next forward
                   needs them, beside its compute (`--overlap-param-gather`). See `param_gather.py`.

Gradient accumulation. ZeRO-1 keeps full gradients anyway, so it accumulates like DDP: run every
backward but the last inside `model.no_sync()`; the last one reduces the sum once. ZeRO-2 and ZeRO-3
keep only a slice, so every backward reduce-scatters and *adds* into the slice: just call backward
on each micro-batch before `step()`. Their no_sync() is accepted (one loop serves every strategy) but
changes nothing: postponing the reduction would need the full gradients they do not keep.

What the user sees of `model.module`'s parameters: ZeRO-1/2 full parameters, ZeRO-3 this rank's pieces
between uses. Their `.grad` after backward is a placeholder that refuses use (`grad_in_slices.py`): the averaged
gradient lives in the slices, so clip with `model.clip_grad_norm_(max_norm)`, clear with `model.zero_grad()` or
the optimizer's, and read the parameters with `full_state_dict()`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..runtime import env
from ..trace.events import phase
from . import check_options, consistency
from .fsdp_unit import dtypes
from .sharded import ShardedModel
from .sharded_optimizer import ShardedOptimizer, check_optimizer
from .zero3 import Zero3  # stage 3 is its own idea, in its own file
from .zero12 import Zero12  # so are stages 1 and 2

OPTIONS = {
    1: ("mixed_precision", "group", "bucket_cap_mb", "reduce", "overlap_grad_reduce", "overlap_param_gather"),
    2: ("mixed_precision", "group", "bucket_cap_mb", "overlap_param_gather"),
    3: ("mixed_precision", "group", "prefetch_bucket_size", "reduce_bucket_size", "sub_group_size"),
}
REDUCE = ("reduce_scatter", "all_reduce")
# why a step of micro-batches under ZeRO-1 runs all but the last inside no_sync(): said by the interfaces that refuse it
ZERO1_REDUCES_ONCE = (
    "zero1 reduce-scatters its whole gradients once a step and cannot add a second reduction into its slices "
    "(zero2 does)"
)


def wrap_zero1(model: nn.Module, optimizer=torch.optim.AdamW, **options):
    """ZeRO stage 1: optimizer states partitioned. Returns (wrapped model, sharded optimizer)."""
    return _wrap(1, model, optimizer, options)


def wrap_zero2(model: nn.Module, optimizer=torch.optim.AdamW, **options):
    """ZeRO stage 2: optimizer states and gradients partitioned."""
    return _wrap(2, model, optimizer, options)


def wrap_zero3(model: nn.Module, optimizer=torch.optim.AdamW, **options):
    """ZeRO stage 3: optimizer states, gradients and parameters partitioned."""
    return _wrap(3, model, optimizer, options)


def _wrap(stage: int, model: nn.Module, optimizer, options: dict):
    name = f"zero{stage}"
    check_options(name, options, OPTIONS[stage])  # every mistake is reported before any collective
    check_optimizer(name, optimizer)
    dtype, grad_dtype = dtypes(options.get("mixed_precision", False))
    if stage == 3 and grad_dtype != dtype:
        raise ValueError(
            f"zero3: mixed_precision's reduce_dtype={grad_dtype} differs from its param_dtype={dtype}; zero3 reduces "
            "in the dtype it computes in. For fp32 reductions of sharded parameters use fsdp, which takes the same "
            "MixedPrecision; zero1 and zero2 take it too."
        )
    reduce = options.get("reduce", "reduce_scatter")
    if reduce not in REDUCE:
        raise ValueError(f"{name}: reduce={reduce!r}; choose one of {REDUCE}.")
    cap = options.get("bucket_cap_mb", 25)
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0:
        raise ValueError(f"{name}: bucket_cap_mb must be a positive number of MiB, got {cap!r}.")
    overlaps = {key: options.get(key, False) for key in ("overlap_grad_reduce", "overlap_param_gather")}
    for key, value in overlaps.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name}: {key} must be True or False, got {value!r}.")
    buckets = {}
    for key in ("prefetch_bucket_size", "reduce_bucket_size", "sub_group_size"):  # stage 3 only (check_options)
        value = buckets[key] = options.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"{name}: {key} is a number of elements (an int >= 0; 0 = one module at a time), got {value!r}."
            )
    if not torch.distributed.is_initialized():
        raise RuntimeError(
            f"{name} shards over ranks, so it needs torch.distributed initialized: run it "
            "inside toolkit.launch(fn, world_size) (world_size=1 works too), or call "
            "toolkit.runtime.init() under torchrun or mpirun."
        )
    group = options.get("group")
    consistency.reject_experts(model, name)
    consistency.check_same_model(model, group)  # a clear error now rather than a hang later
    model.to(env.device())
    with phase("setup"):  # every rank starts from rank 0's values
        consistency.broadcast_from_rank0([*model.parameters(), *model.buffers()], group)
    if stage == 3:
        engine = Zero3(model, dtype, group, **buckets)
    else:
        engine = Zero12(model, stage, dtype, group, reduce, cap * 2**20, grad_dtype=grad_dtype, **overlaps)
    # The user's optimizer, built on this rank's fp32 slices only: that is the stage-1 saving.
    engine.optimizer = ShardedOptimizer(optimizer([s.master for s in engine.shards()]), engine)
    return ShardedModel(model, engine), engine.optimizer
