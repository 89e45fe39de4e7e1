"""Lab 08: mixed precision in FSDP, written by you: bf16 compute and communication, fp32 master weights.

Four methods of `MixedUnit` are yours (marked "yours" below): `unshard`, `add_grad`, `reduce_grad` and
`finish_reduce`. Each is a few lines; what matters is the dtype of every tensor they touch. The rest is
the toolkit's FSDP (`toolkit.parallel.wrap(model, "fsdp", mixed_precision=..., unit_class=MixedUnit)`, the
given `wrap` below). Read README.md first, then grade your work with

    python -m toolkit grade labs/08-mixed-precision                     # grades this file
    python -m toolkit grade labs/08-mixed-precision --solution my.py    # or a copy of it

Rule of the game: every collective goes through `toolkit.comm`, so the trace records what travelled in
which dtype, and the grader counts the bytes.
"""
from __future__ import annotations

import functools

import torch

import toolkit
from toolkit import comm  # noqa: F401 - you will need it
from toolkit.parallel.flat import FlatBuffer  # noqa: F401 - you will need it
from toolkit.parallel.fsdp_unit import GATHERING, SHARDED, FSDPUnit, MixedPrecision  # noqa: F401


class MixedUnit(FSDPUnit):
    """One FSDP unit under mixed precision. What `FSDPUnit.__init__` set up (given):

    self.master    this rank's slice of the unit, fp32 (an nn.Parameter): the master weights the optimizer
                   steps. They stay fp32 for good: an update smaller than bf16's spacing (lr x a small
                   gradient, on a weight near 1) would be rounded away if the weights lived in bf16.
    self.flat      a FlatBuffer in param_dtype (bf16): the gathered unit the module computes with; its
                   storage holds 0 bytes while the unit is sharded. `self.flat.allocate()` gives it back.
    self.sharding  .param_dtype (compute and all-gather), .reduce_dtype (the gradients' reduce-scatter),
                   .shard_group, .size, .rank
    self.index     {parameter: its position in the unit}; self.waiting: gradients not yet arrived
    self.grads     your flat gradient buffer (None until the first gradient of a backward)
    self.state, self._gather   as in lab 03 (`wait_unshard` and `reshard` are given, from FSDPUnit)
    """

    # --- yours: 1. fp32 masters -> bf16 parameters, on the wire already in bf16 ------------------------------
    def unshard(self, async_op: bool = False) -> None:
        """If the unit is SHARDED: `self.flat.allocate()`, then all-gather every rank's master slice *cast
        to param_dtype* into `self.flat.data` (already param_dtype):
        `piece = self.master.detach().to(self.sharding.param_dtype)` and
        `handle = comm.all_gather(self.flat.data, piece, group=self.sharding.shard_group, async_op=True)`;
        keep `self._gather = (handle, piece)` and set `self.state = GATHERING`.
        Then, unless `async_op`, `self.wait_unshard()`.
        Casting *before* the gather is the point: 2 bytes per element travel instead of 4."""
        raise NotImplementedError("unshard: cast the fp32 master to param_dtype, then all-gather it")

    # --- yours: 2. bf16 gradients -> a flat buffer in reduce_dtype -----------------------------------------
    def add_grad(self, p) -> bool:
        """`p.grad` (param_dtype: backward ran in bf16) is final for this backward. On the first gradient
        make the flat buffer `self.grads = FlatBuffer(self.flat.shapes, self.sharding.size,
        dtype=self.sharding.reduce_dtype, device=self.master.device)` (zeros); add `p.grad` into its view
        `self.grads.view(self.index[p])` (the add casts bf16 up to reduce_dtype); `p.grad = None`;
        `self.waiting -= 1`; return True when it was the unit's last gradient (`self.waiting == 0`)."""
        raise NotImplementedError("add_grad: add p.grad into a flat buffer of dtype reduce_dtype")

    # --- yours: 3. the reduce-scatter, in reduce_dtype -----------------------------------------------------
    def reduce_grad(self) -> None:
        """Average the flat gradient over the group in reduce_dtype, rank r receiving slice r: an output
        `torch.empty(self.grads.shard_numel, dtype=self.grads.data.dtype, device=self.master.device)`,
        `comm.reduce_scatter(output, self.grads.data, op="avg", group=self.sharding.shard_group,
        async_op=True)`; `self.reduction = (handle, output, self.grads)`; `self.grads = None`.
        reduce_dtype bf16 halves these bytes too; fp32 (MixedPrecision(bf16, reduce_dtype=torch.float32))
        sums many ranks' gradients without bf16's rounding, for twice the bytes."""
        raise NotImplementedError("reduce_grad: reduce-scatter (op='avg') in reduce_dtype")

    # --- yours: 4. back to fp32 for the optimizer ------------------------------------------------------------
    def finish_reduce(self) -> None:
        """`handle, out, _ = self.reduction`; wait; `self.reduction = None`. Cast `out` to fp32 and add it
        into `self.mine.grad` (fp32: set it when None, else add in place), so that several micro-batches
        accumulate in fp32 and the optimizer steps fp32 masters with fp32 gradients."""
        raise NotImplementedError("finish_reduce: wait, cast to fp32, accumulate into self.mine.grad")


# --- given: FSDP with your unit ----------------------------------------------------------------------------
def wrap(model: torch.nn.Module, mixed_precision=MixedPrecision(torch.bfloat16),
         optimizer=functools.partial(torch.optim.AdamW, lr=1e-3), **options):
    """`toolkit.parallel.wrap(model, "fsdp", mixed_precision=..., unit_class=MixedUnit)`: (model, optimizer)."""
    return toolkit.parallel.wrap(model, "fsdp", optimizer=optimizer, mixed_precision=mixed_precision,
                                 unit_class=MixedUnit, **options)
