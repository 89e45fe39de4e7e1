"""Lab 03: one FSDP unit, gathered, freed and reduced by you. (Reference solution.)

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
from toolkit import comm
from toolkit.parallel.fsdp_unit import GATHERED, GATHERING, SHARDED, FSDPUnit


class MyUnit(FSDPUnit):
    """One FSDP unit. What you can use (all set up by `FSDPUnit.__init__`):

    self.flat      a FlatBuffer: `self.flat.data` is the unit's whole flat parameter, a 1-D tensor of
                   `self.flat.padded_numel` elements (the unit's tensors end to end, padded with zeros to
                   a multiple of the group size); 0 bytes while the unit is sharded. FSDP points the module's
                   parameters into it once gathered (between uses, at this rank's pieces of `self.master`).
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
        all-gather every rank's slice into it. With `async_op`, return while the bytes travel."""
        if self.state == SHARDED:  # else gathered already, or on its way (prefetched)
            data = self.flat.data
            data.untyped_storage().resize_(self.flat.padded_numel * data.element_size())
            piece = self.master.detach().to(data.dtype)  # fp32: the master itself, no copy
            handle = comm.all_gather(data, piece, group=self.sharding.shard_group, async_op=True)
            self.pending = (handle, piece)  # keep the input alive until the all-gather is done
            self.state = GATHERING
        if not async_op:  # a prefetched unit's all-gather may still be in flight: finish it
            self.wait_unshard()

    def wait_unshard(self) -> None:
        """If an all-gather is in flight, wait for it; the unit is then GATHERED."""
        if self.state == GATHERING:
            self.pending[0].wait()
            self.pending = None
            self.state = GATHERED

    # --- yours: 2. free it again -----------------------------------------------------------------------
    def reshard(self) -> None:
        """Drop the full parameters: resize the flat parameter's storage to 0 bytes. Never free memory
        an all-gather is still writing into. The master slice stays as it is."""
        if self.state == GATHERING:
            self.wait_unshard()
        self.flat.data.untyped_storage().resize_(0)
        self.state = SHARDED

    # --- yours: 3. reduce-scatter the gradient -----------------------------------------------------------
    def reduce_grad(self) -> None:
        """Start averaging the unit's full gradient over the group, rank r receiving slice r only."""
        out = torch.empty(self.grads.shard_numel, dtype=self.grads.data.dtype, device=self.master.device)
        handle = comm.reduce_scatter(out, self.grads.data, op="avg", group=self.sharding.shard_group, async_op=True)
        self.reduction = (handle, out, self.grads)
        self.grads = None


# --- given: FSDP with your unit ------------------------------------------------------------------------
def wrap(model: torch.nn.Module, optimizer=functools.partial(torch.optim.SGD, lr=0.1), **options):
    """`toolkit.parallel.wrap(model, "fsdp", ...)` with every unit a `MyUnit`. Returns (model, optimizer)."""
    return toolkit.parallel.wrap(model, "fsdp", optimizer=optimizer, unit_class=MyUnit, **options)
