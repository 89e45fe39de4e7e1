"""Flatten, pad, shard: the bookkeeping that ZeRO and FSDP share.

Sharded data parallelism cuts "the model" into N equal pieces, one per rank. A model is a list of
tensors of awkward shapes, so first lay them end to end in one 1-D tensor (a *flat buffer*); then
the piece that rank r owns is just a slice of it:

    tensors      [ a a a a a | b b b | c c c c c c c ]             15 elements
    flat buffer  [ a a a a a b b b c c c c c c c . ]               padded to 16 (N = 4)
    shards       [ rank 0  ][ rank 1  ][ rank 2  ][ rank 3 ]        S = 16 / 4 = 4 each

The padding rule: collectives want equal pieces (a reduce-scatter hands every rank the same number of
elements, an all-gather takes the same number from every rank), so the flat buffer is padded with
zeros up to the next multiple of N. That is at most N-1 extra elements per buffer, whatever the
model's size (the FSDP paper's "at most F-1"). Padding elements are zeros, their gradients are zeros,
and an elementwise optimizer leaves a zero with a zero gradient at zero (weight decay shrinks it
towards zero, momentum stays zero), so padding never leaks into the real parameters.

A tensor may straddle a shard boundary (`b` above belongs to ranks 1 and 2): the owner of a shard
updates whatever elements fall in it, which is why only optimizers that treat every element on its
own can be sharded this way (see `toolkit.parallel.sharded`).

`FlatBuffer` holds the flat tensor plus the layout: where each original tensor lives, views back onto
their shapes, and which slice each rank owns. Its storage can be freed and re-allocated in place
(ZeRO-3 and FSDP free gathered parameters between uses) without breaking views taken from it.
`ParamViews` points a module's parameters at the full views while a unit is gathered and at this rank's pieces
of them between uses, so a parameter never reaches into freed memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


def holds(t: torch.Tensor) -> bool:
    """Whether `t`'s storage still holds every element the view reaches. A view of a freed flat buffer (what autograd
    saved of a ZeRO-3 or FSDP unit's gathered parameters, once the unit is freed) keeps its shape over 0 bytes:
    reading or writing it would touch freed memory."""
    last = t.storage_offset() + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.numel() == 0 or t.untyped_storage().nbytes() >= (last + 1) * t.element_size()


def padded_numel(numel: int, world_size: int) -> int:
    """`numel` rounded up to a multiple of `world_size`: the size of a flat buffer that splits evenly."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    return numel + (-numel) % world_size


@dataclass(frozen=True)
class Piece:
    """The part of tensor `index` that falls in one rank's shard.

    Elements [tensor_start, tensor_end) of the flattened tensor are elements
    [shard_start, shard_end) of the shard.
    """

    index: int
    tensor_start: int
    tensor_end: int
    shard_start: int
    shard_end: int

    @property
    def numel(self) -> int:
        return self.tensor_end - self.tensor_start


class FlatBuffer:
    """Tensors of any shapes laid end to end in one 1-D tensor, padded to a multiple of `world_size`.

    buffer = FlatBuffer([p.shape for p in params], world_size=4, dtype=torch.float32)
    buffer.copy_from(params)          # values in
    views = buffer.views()            # one view per tensor, shaped like it, sharing the buffer's memory
    mine = buffer.shard(rank)         # the slice [rank*S, (rank+1)*S) this rank owns

    Attributes: `shapes`, `numels`, `offsets` (where each tensor starts), `numel` (real elements),
    `padding` (< world_size zeros at the end), `shard_numel` (S), `data` (the 1-D tensor).
    """

    def __init__(
        self,
        shapes: Sequence[Sequence[int]],
        world_size: int,
        *,
        dtype=torch.float32,
        device=None,
        data: torch.Tensor | None = None,
    ):
        self.shapes = [torch.Size(s) for s in shapes]
        self.numels = [s.numel() for s in self.shapes]
        self.offsets = []
        offset = 0
        for n in self.numels:
            self.offsets.append(offset)
            offset += n
        self.numel = offset
        self.world_size = world_size
        self.padded_numel = padded_numel(self.numel, world_size)
        self.padding = self.padded_numel - self.numel
        self.shard_numel = self.padded_numel // world_size
        if data is None:
            data = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        elif data.dim() != 1 or data.numel() != self.padded_numel:
            raise ValueError(
                f"a FlatBuffer of these shapes needs a 1-D tensor of {self.padded_numel} "
                f"elements, got shape {tuple(data.shape)}."
            )
        self.data = data

    @classmethod
    def of(cls, tensors: Iterable[torch.Tensor], world_size: int, *, dtype=None, device=None) -> FlatBuffer:
        """A new buffer holding copies of `tensors` (in `dtype`, default: the first tensor's)."""
        tensors = list(tensors)
        dtype = dtype or tensors[0].dtype
        device = device or tensors[0].device
        buffer = cls([t.shape for t in tensors], world_size, dtype=dtype, device=device)
        buffer.copy_from(tensors)
        return buffer

    # --- views and values ------------------------------------------------------------------------
    def view(self, index: int) -> torch.Tensor:
        """Tensor `index` as a view into the buffer (writing one writes the other)."""
        start = self.offsets[index]
        return self.data[start : start + self.numels[index]].view(self.shapes[index])

    def views(self) -> list[torch.Tensor]:
        return [self.view(i) for i in range(len(self.shapes))]

    @torch.no_grad()
    def copy_from(self, tensors: Iterable[torch.Tensor]) -> None:
        """Write `tensors` (in layout order) into the buffer; the padding stays zero."""
        for view, t in zip(self.views(), tensors, strict=True):
            view.copy_(t)
        if self.padding:
            self.data[self.numel :].zero_()

    # --- shards ----------------------------------------------------------------------------------
    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of the slice of the flat buffer that `rank` owns."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}.")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def shard(self, rank: int) -> torch.Tensor:
        """The slice `rank` owns, as a view into the buffer."""
        start, end = self.shard_range(rank)
        return self.data[start:end]

    def pieces(self, rank: int) -> list[Piece]:
        """The parts of each tensor that fall in `rank`'s shard, in layout order (padding excluded)."""
        lo, hi = self.shard_range(rank)
        found = []
        for index, (start, n) in enumerate(zip(self.offsets, self.numels)):
            a, b = max(lo, start), min(hi, start + n)
            if a < b:
                found.append(Piece(index, a - start, b - start, a - lo, b - lo))
        return found

    def piece_views(self, shard: torch.Tensor, rank: int) -> list[torch.Tensor]:
        """Each tensor's part in `rank`'s shard, as a 1-D view of `shard` (a tensor laid out as that shard: the
        master slice); empty for a tensor with no element there."""
        parts = {p.index: shard[p.shard_start : p.shard_end] for p in self.pieces(rank)}
        return [parts.get(i, shard[:0]) for i in range(len(self.shapes))]

    def owners(self, index: int) -> list[int]:
        """The ranks whose shards hold some of tensor `index` (one, or several when it straddles)."""
        start, n = self.offsets[index], self.numels[index]
        if n == 0:
            return []
        return list(range(start // self.shard_numel, (start + n - 1) // self.shard_numel + 1))

    # --- memory ----------------------------------------------------------------------------------
    @property
    def is_allocated(self) -> bool:
        return self.data.untyped_storage().nbytes() > 0

    def free(self) -> None:
        """Release the buffer's memory but keep the tensor (and every view of it) alive.

        The storage shrinks to 0 bytes; views taken earlier (a module's parameters, tensors autograd
        saved for backward) stay valid objects and see new values once `allocate()` and a fill run.
        """
        self.data.untyped_storage().resize_(0)

    def allocate(self) -> None:
        """Give a freed buffer its memory back (uninitialized: fill it next, e.g. with an all-gather)."""
        if not self.is_allocated:
            self.data.untyped_storage().resize_(self.padded_numel * self.data.element_size())

    def __repr__(self) -> str:
        return (
            f"FlatBuffer({len(self.shapes)} tensors, {self.numel} elements + {self.padding} padding, "
            f"{self.world_size} shards of {self.shard_numel}, {self.data.dtype})"
        )


class ParamViews:
    """Where a sharded unit's parameters point: at the gathered flat buffer while the unit computes, at this rank's
    pieces of its kept slice between uses (FSDP1's `use_orig_params`).

    Between uses the flat buffer holds 0 bytes, and a parameter that still viewed it (full shape, no memory) would
    make `p.sum()` read freed memory and kill the rank. Pointed at the kept slice instead, `p` is the part of it this
    rank holds, 1-D (empty when none of it is here), updated in place by the optimizer: reading it is safe and shows
    what ZeRO-3 is. `.data` is swapped, not the Parameter: autograd's references to `p`, its hooks and every name stay.
    """

    def __init__(self, params: Sequence[torch.Tensor], flat: FlatBuffer, kept: torch.Tensor, rank: int):
        self.params = list(params)
        self.whole = flat.views()  # stay valid while the storage is freed and re-allocated under them
        self.pieces = flat.piece_views(kept.detach(), rank)
        self.is_full = True

    def full(self) -> None:
        self._point(self.whole)
        self.is_full = True

    def sharded(self) -> None:
        self._point(self.pieces)
        self.is_full = False

    def _point(self, views: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, view in zip(self.params, views):
                p.data = view
