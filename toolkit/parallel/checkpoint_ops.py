"""Selective checkpointing by operation: inside a checkpointed block, keep what is dear to recompute.

    model, opt = toolkit.parallel.wrap(model, "fsdp", activation_checkpointing="op")

Checkpointing a whole block keeps its input and runs its forward again in backward: a third more of the step's
FLOPs. Most of what a block saves for backward, though, comes from cheap operations (norms, activations, adds,
dropout masks, the softmax statistics' neighbours), and most of its FLOPs from a few (the matmuls, attention).
torchtitan's per-operator policy (`selective_ac_option="op"`, torchtitan/parallelisms/parallelize_llama.py at
157a12c, 2024-04) saves the outputs of the dear ones and recomputes the rest: every attention output, every
reduce-scatter's, and every matmul's but every second one (the 2nd, 4th, ... in the block's forward), so that a
step pays about half a matmul pass more and keeps about half the matmuls' outputs. torch's selective checkpointing
(`torch.utils.checkpoint.create_selective_checkpoint_contexts`) runs the policy: each operation of the recomputed
forward either returns what the forward cached or computes again.

Where the toolkit differs: its GPT's linear layers have biases, so its matmuls are `addmm` as well as `mm` (both
count as matmuls here; torchtitan's Llama has no biases), and the fused attention op on the CPU (and on meta
tensors, in the simulator) is `_scaled_dot_product_flash_attention_for_cpu`.
"""

from __future__ import annotations

import collections
import contextlib
import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from . import rng

aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default}
SAVED = MATMULS | {
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}


def _policy(counts: dict, ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Save an expensive operation's output, but only every other matmul's (counted apart in the forward and in
    the recomputation, so that both make the same choices); recompute the rest."""
    if func in MATMULS:
        counts[ctx.is_recompute] += 1
        if counts[ctx.is_recompute] % 2 == 0:
            return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if func in SAVED else CheckpointPolicy.PREFER_RECOMPUTE


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


def selective_contexts():
    """torch.utils.checkpoint's `context_fn` for a block checkpointed by operation: torch's selective checkpointing
    under the policy above, and the tensor-parallel stream's state replayed in the recomputation (`rng.py`)."""
    keep, replay = create_selective_checkpoint_contexts(functools.partial(_policy, collections.Counter()))
    at_forward, again = rng.checkpoint_contexts()
    return _both(at_forward, keep), _both(again, replay)
