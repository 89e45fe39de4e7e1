"""Lab 06: ZeRO, written by you: stage 2's gradient reduce-scatter and the partitioned optimizer step.

Three pieces are yours (marked "yours" below): `shard_bounds`, `Zero2.reduce_gradients` and `Zero2.step`.
The rest is given: the flat buffer the model's parameters live in, this rank's fp32 master slice, the
optimizer built on that slice alone, and the hook that calls `reduce_gradients()` once backward is over.
Read README.md first, then grade your work with

    python -m toolkit grade labs/06-zero                     # grades this file
    python -m toolkit grade labs/06-zero --solution my.py    # or a copy of it

Rule of the game: every collective goes through `toolkit.comm` (`comm.reduce_scatter`, `comm.all_gather`),
so the trace records it and the grader can count what travelled.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from toolkit import comm
from toolkit.parallel.flat import FlatBuffer


# --- yours: 1. which slice is mine ----------------------------------------------------------------------
def shard_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int, int]:
    """(start, end, padded): rank `rank`'s slice [start, end) of a flat buffer of `numel` elements, once the
    buffer is padded with zeros to `padded`.

    Why padding: a reduce-scatter and an all-gather move equal pieces, one per rank, so the buffer must
    split into world_size slices of the same size, and the zeros at the end change no sum. `padded` is the
    smallest such size; slices are contiguous, in rank order, and together cover [0, padded).
    """
    raise NotImplementedError("shard_bounds: not written yet")


class Zero2:
    """ZeRO stage 2 for a plain model. What `__init__` (given) sets up:

    self.params    the model's trainable parameters; each is now a *view* of `self.flat`
    self.flat      a FlatBuffer: `self.flat.data` is every parameter end to end in one fp32 1-D tensor,
                   padded to `self.flat.padded_numel` (a multiple of the world size); `self.flat.shapes`,
                   `self.flat.views()`, `self.flat.shard_numel` (elements per rank)
    self.master    this rank's slice of `self.flat.data` (an nn.Parameter, and a view: stepping it updates
                   the model's own parameters in place, for this slice)
    self.optimizer the user's optimizer (AdamW, say) built on [self.master] only: its states (Adam's two
                   moments) exist for this rank's 1/N of the parameters, not for all of them
    self.group, self.world, self.rank   the process group, its size N, this rank's position in it
    """

    def __init__(self, model: nn.Module, optimizer=torch.optim.AdamW, group=None):
        self.group = group
        ranks = comm.group_ranks(group)
        self.world = len(ranks)
        self.rank = ranks.index(torch.distributed.get_rank())
        self.params = list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))
        self.flat = FlatBuffer.of(self.params, self.world, dtype=torch.float32)
        with torch.no_grad():
            for p, view in zip(self.params, self.flat.views()):
                p.data = view  # the model computes with views of the flat buffer
        start, end, padded = shard_bounds(self.flat.numel, self.world, self.rank)
        assert padded == self.flat.padded_numel, "shard_bounds disagrees with the flat buffer's padding"
        self.master = nn.Parameter(self.flat.data[start:end])  # a view: stepping it updates the model's slice
        self.optimizer = optimizer([self.master])
        self._queued = False
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._gradient_arrived)

    def _gradient_arrived(self, p) -> None:
        if not self._queued:  # once per backward: have _end_of_backward run when autograd is done
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._queued = False
        self.reduce_gradients()

    # --- yours: 2. stage 2's reduce-scatter ----------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """Called once backward is over: every `p.grad` holds this rank's gradient of its own rows.

        Afterwards: `self.master.grad` (shape of `self.master`) holds the *average over the ranks* of this
        rank's slice of the flat gradient (laid out exactly like `self.flat`: same order, same padding, with
        zeros where a parameter has no gradient), and no parameter holds a full gradient any more.

        Why: the batch is split over the ranks, so the whole batch's gradient is the mean of theirs; stage 2
        keeps only the slice this rank's optimizer updates, 1/N of the gradients (lesson 03's accounting).
        One collective delivers exactly that slice, moving Ψ(N-1)/N bytes per rank; an all-reduce would move twice
        that and hand every rank the whole gradient, which it would then throw away.
        """
        raise NotImplementedError("reduce_gradients: not written yet")

    # --- yours: 3. the partitioned step ------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """One optimizer step: afterwards every rank's model holds the whole updated parameters, and the slice's
        gradient, used, is dropped (`self.master.grad` is None: stage 2 keeps no gradient from one step to the next,
        and the grader looks).

        This rank's optimizer knows only its slice (`self.master`, a view of `self.flat.data`): stepping it
        updates 1/N of the model, here. The other slices were updated on their owners, so each rank must then
        receive every other rank's updated slice, at its place in the flat buffer (Ψ(N-1)/N bytes per rank:
        with the reduce-scatter, 2Ψ per step, as much as plain data parallelism). A collective's input must not
        be a view of the buffer it writes into.
        """
        raise NotImplementedError("step: not written yet")

    def zero_grad(self) -> None:
        self.master.grad = None
        for p in self.params:
            p.grad = None
