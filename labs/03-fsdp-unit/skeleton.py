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
    self._gather   free for your `unshard` and `wait_unshard`: what an all-gather in flight needs kept.

    A FlatBuffer also has `.allocate()` (gives a freed storage its bytes back, values undefined) and `.free()`
    (storage to 0 bytes, the tensor and its views stay). README.md lists the collectives' signatures.
    """

    # --- yours: 1. gather the whole unit ---------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        """Make the full parameters appear in `self.flat.data`: every rank's slice (`self.master`) at its place,
        gathered over the unit's shard group through `toolkit.comm`. With `async_op`, return while the bytes travel
        (the unit is then GATHERING, and `wait_unshard` finishes it); without, return once the unit is GATHERED.

        What to get right: a unit already GATHERED, or GATHERING (prefetched), is not gathered again; but a
        prefetched unit's all-gather may still be in flight when FSDP asks for the unit, and it must be finished
        before the unit computes. While the unit is SHARDED its flat parameter's storage holds 0 bytes: it needs its
        bytes back (`self.flat.padded_numel` elements) before anything can land in it. Whatever an asynchronous
        collective reads or writes must stay alive until it is waited for.
        """
        raise NotImplementedError("unshard: not written yet")

    def wait_unshard(self) -> None:
        """If an all-gather is in flight (GATHERING), wait for it: the unit is then GATHERED, and nothing of the
        all-gather is kept. In any other state, do nothing.
        """
        raise NotImplementedError("wait_unshard: not written yet")

    # --- yours: 2. free it again -----------------------------------------------------------------------
    def reshard(self) -> None:
        """Drop the full parameters: afterwards the flat parameter's storage holds 0 bytes and the unit is SHARDED; the
        master slice stays as it is. The tensor itself must stay (the module's parameters and the tensors autograd
        saved for backward are views of it: the next unshard refills them in place), and memory an all-gather is
        still writing into is never freed.
        """
        raise NotImplementedError("reshard: not written yet")

    # --- yours: 3. reduce-scatter the gradient -----------------------------------------------------------
    def reduce_grad(self) -> None:
        """Start averaging the unit's full flat gradient (`self.grads.data`: this rank's gradient of its own rows,
        padded like the flat parameter) over the shard group, asynchronously: rank r receives only slice r, the
        average over the ranks (the whole batch's gradient is the mean of theirs). Leave (handle, output, input) in
        `self.reduction` for `finish_reduce` (given: it waits and adds the slice into the shard's fp32 gradient; the
        input must live until the bytes have travelled). Afterwards `self.grads` is None: FSDP makes a fresh buffer
        for the next backward.
        """
        raise NotImplementedError("reduce_grad: not written yet")


# --- given: FSDP with your unit ------------------------------------------------------------------------
def wrap(model: torch.nn.Module, optimizer=functools.partial(torch.optim.SGD, lr=0.1), **options):
    """`toolkit.parallel.wrap(model, "fsdp", ...)` with every unit a `MyUnit`. Returns (model, optimizer)."""
    return toolkit.parallel.wrap(model, "fsdp", optimizer=optimizer, unit_class=MyUnit, **options)
