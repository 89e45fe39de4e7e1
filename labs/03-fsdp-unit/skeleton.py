"""Lab 03: one FSDP unit, gathered, freed and reduced by you.

Four methods of `MyUnit` are yours (marked "yours" below): `unshard`, `wait_unshard`, `reshard` and
`reduce_grad`. Everything else (the flat parameter, the shard, the schedule of hooks that decides when
each unit is gathered, freed and reduced) is the toolkit's FSDP, which calls your methods once you
plug the class in: `toolkit.parallel.wrap(model, "fsdp", unit_class=MyUnit)` (the `wrap` below).
Read README.md first, then grade your work with

    python -m toolkit grade labs/03-fsdp-unit                     # grades skeleton.py
    python -m toolkit grade labs/03-fsdp-unit --solution my.py    # or a copy of it

Rule of the game: every collective goes through `toolkit.comm` (`comm.all_gather`, `comm.reduce_scatter`),
so the trace records it and the grader can count your collectives and the bytes they carried.
"""
from __future__ import annotations

import functools

import torch

import toolkit
from toolkit import comm  # noqa: F401 - you will need it
from toolkit.parallel.fsdp_unit import GATHERED, GATHERING, SHARDED, FSDPUnit  # noqa: F401


class MyUnit(FSDPUnit):
    """One FSDP unit. What you can use (all set up by `FSDPUnit.__init__`):

    self.flat      a FlatBuffer: `self.flat.data` is the unit's whole flat parameter, a 1-D tensor of
                   `self.flat.padded_numel` elements (the unit's tensors end to end, padded with zeros to
                   a multiple of the group size). The module's parameters are views into it. While the
                   unit is sharded its storage holds 0 bytes.
    self.master    this rank's slice of the flat parameter (fp32, `self.flat.shard_numel` elements): the
                   values the optimizer updates, kept all the time.
    self.sharding  `.shard_group` (the process group the unit is sharded over), `.size` (its N), `.rank`
                   (this rank's place in it, which is the slice it owns).
    self.state     SHARDED, GATHERING (all-gather in flight) or GATHERED.
    self.grads     during backward, a FlatBuffer holding the unit's full flat gradient (`self.grads.data`),
                   this rank's gradient of its own rows of the batch. FSDP fills it; you reduce it.
    self.reduction what `reduce_grad` leaves for `finish_reduce` (given): (handle, output, input).
    """

    # --- yours: 1. gather the whole unit ---------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        """Make the full parameters appear in `self.flat.data`: give its storage its bytes back and
        all-gather every rank's slice into it. With `async_op`, return while the bytes travel.

        Steps 1 to 4 only when the unit is SHARDED (it may be gathered already, or prefetched: GATHERING).
        1. Give the flat parameter its memory back. It is `self.flat.data`, a 1-D tensor whose storage was
           resized to 0 bytes; resize it to `self.flat.padded_numel * self.flat.data.element_size()` bytes
           with `.untyped_storage().resize_(...)`. The values are garbage until the all-gather fills them.
        2. The input is this rank's slice: `self.master.detach().to(self.flat.data.dtype)` (in fp32 that is
           the master itself). Issue `comm.all_gather(output, input, group=self.sharding.shard_group,
           async_op=True)`: it returns a handle at once, and rank r's slice lands in elements
           [r * shard_numel, (r + 1) * shard_numel) of the output.
        3. Keep the handle (and the input: it must live until the all-gather is done) on `self`.
        4. Set `self.state = GATHERING`.
        Then, whatever the state was, unless `async_op`: `self.wait_unshard()`. A prefetched unit's
        all-gather may still be in flight when FSDP asks for the unit: it must be finished before the
        unit computes, or the unit computes with half-written parameters.
        """
        raise NotImplementedError("unshard: resize the flat parameter's storage back, all-gather the slices into it")

    def wait_unshard(self) -> None:
        """If an all-gather is in flight (state GATHERING), wait for its handle, drop what you kept for it,
        and set the state to GATHERED. In any other state, do nothing."""
        raise NotImplementedError("wait_unshard: wait for the all-gather's handle, then the unit is GATHERED")

    # --- yours: 2. free it again -----------------------------------------------------------------------
    def reshard(self) -> None:
        """Drop the full parameters: resize the flat parameter's storage to 0 bytes. Never free memory
        an all-gather is still writing into. The master slice stays as it is.

        1. If the unit is GATHERING, `self.wait_unshard()` first.
        2. `self.flat.data.untyped_storage().resize_(0)`: the memory goes, the tensor stays. The module's
           parameters (views of it) and the tensors autograd saved for backward keep pointing at this
           storage, so the next unshard refills them in place: nothing needs to be re-attached.
        3. `self.state = SHARDED`.
        """
        raise NotImplementedError("reshard: resize the flat parameter's storage to 0 bytes")

    # --- yours: 3. reduce-scatter the gradient -----------------------------------------------------------
    def reduce_grad(self) -> None:
        """Start averaging the unit's full gradient over the group, rank r receiving slice r only.

        FSDP calls this once the unit's backward is done: `self.grads.data` holds the unit's whole flat
        gradient on this rank (padded like the flat parameter), computed from this rank's rows only.
        1. An output for this rank's slice: `torch.empty(self.grads.shard_numel, dtype=self.grads.data.dtype,
           device=self.master.device)`.
        2. `comm.reduce_scatter(output, self.grads.data, op="avg", group=self.sharding.shard_group,
           async_op=True)`: every rank ends with the *average* over the ranks of slice r of everyone's
           gradient (op="avg": the batch is split over the ranks, so its gradient is the mean of theirs).
        3. Leave `(handle, output, self.grads)` in `self.reduction` (`finish_reduce`, given, waits for the
           handle and adds the output into the shard's fp32 gradient; keeping the input there keeps it
           alive while the bytes travel), then set `self.grads = None` (the next backward starts anew).
        """
        raise NotImplementedError("reduce_grad: reduce-scatter the full flat gradient with op='avg'")


# --- given: FSDP with your unit ------------------------------------------------------------------------
def wrap(model: torch.nn.Module, optimizer=functools.partial(torch.optim.SGD, lr=0.1), **options):
    """`toolkit.parallel.wrap(model, "fsdp", ...)` with every unit a `MyUnit`. Returns (model, optimizer)."""
    return toolkit.parallel.wrap(model, "fsdp", optimizer=optimizer, unit_class=MyUnit, **options)
