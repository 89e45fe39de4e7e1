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
        """Make the full parameters appear in `self.flat.data`, in param_dtype (bf16), from every rank's fp32 master
        slice; with `async_op`, return while the bytes travel (state GATHERING, finished by `wait_unshard`, given),
        else return once the unit is GATHERED. A unit already gathered or on its way is left as it is.

        What to get right: the rounding to param_dtype must happen *before* the bytes leave this rank. Mixed
        precision halves the all-gather only if 2 bytes per element travel; gathering the fp32 masters and rounding
        afterwards gives the same parameters for twice the bytes (the grader reads the dtype on the wire). The
        masters stay fp32. The flat parameter's storage is empty while the unit is sharded (`self.flat.allocate()`
        gives it back), and whatever an asynchronous collective reads must stay alive until it is waited for
        (`self._gather`, which `wait_unshard` uses, is (handle, input)).
        """
        raise NotImplementedError("unshard: not written yet")

    # --- yours: 2. bf16 gradients -> a flat buffer in reduce_dtype -----------------------------------------
    def add_grad(self, p) -> bool:
        """`p.grad` (in param_dtype: backward ran in bf16) is final for this backward: add it into the unit's flat
        gradient buffer, `self.grads`, and drop it. Return True when it was the unit's last gradient of this
        backward, which is when FSDP calls `reduce_grad`. `self.waiting` counts the unit's gradients still to come:
        `FSDPUnit.__init__` sets it to the number of parameters, your `add_grad` counts it down, and FSDP sets it back
        to that number at the end of every backward (you never reset it).

        The buffer is laid out like the flat parameter (`self.flat.shapes`, padded for `self.sharding.size` ranks;
        `self.index[p]` is p's place in it), in reduce_dtype, and starts at zero on the first gradient of a
        backward: the padding, and any parameter without a gradient, add nothing. Its dtype decides the precision
        and the bytes of the reduction that follows.
        """
        raise NotImplementedError("add_grad: not written yet")

    # --- yours: 3. the reduce-scatter, in reduce_dtype -----------------------------------------------------
    def reduce_grad(self) -> None:
        """Start averaging the flat gradient over the shard group, asynchronously, in reduce_dtype: rank r ends with
        the average over the ranks of slice r (the batch is split over the ranks, so the whole batch's gradient is
        the mean of theirs). Leave (handle, output, input) in `self.reduction` for `finish_reduce` (the input must
        live until the bytes have travelled) and start the next backward with no buffer.

        reduce_dtype bf16 halves these bytes too; fp32 (MixedPrecision(bf16, reduce_dtype=torch.float32)) sums many
        ranks' gradients without bf16's rounding, for twice the bytes.
        """
        raise NotImplementedError("reduce_grad: not written yet")

    # --- yours: 4. back to fp32 for the optimizer ------------------------------------------------------------
    def finish_reduce(self) -> None:
        """Finish what `reduce_grad` started and hand the optimizer its gradient: afterwards `self.mine.grad` holds
        this rank's slice in fp32, *accumulated* over the backwards since the last `zero_grad` (two micro-batches
        before one step add up), and `self.reduction` is empty. The optimizer steps fp32 masters with fp32
        gradients: an update smaller than bf16's spacing would otherwise be rounded away.
        """
        raise NotImplementedError("finish_reduce: not written yet")


# --- given: FSDP with your unit ----------------------------------------------------------------------------
def wrap(
    model: torch.nn.Module,
    mixed_precision=MixedPrecision(torch.bfloat16),
    optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
    **options,
):
    """`toolkit.parallel.wrap(model, "fsdp", mixed_precision=..., unit_class=MixedUnit)`: (model, optimizer)."""
    return toolkit.parallel.wrap(
        model, "fsdp", optimizer=optimizer, mixed_precision=mixed_precision, unit_class=MixedUnit, **options
    )
