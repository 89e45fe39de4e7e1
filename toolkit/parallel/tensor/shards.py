"""Which piece of a full weight a tensor-parallel rank holds, and how the pieces join again.

A split layer keeps its parameters under their original names, with one dimension cut t ways:

    Split(dim=0)            rows r*n/t .. (r+1)*n/t - 1   (a column-parallel Linear's weight (out, in) and
                                                          bias, a vocabulary-parallel embedding (V, h))
    Split(dim=1)            columns                       (a row-parallel Linear's weight (out, in))
    Split(dim=0, parts=3)   the dimension is three blocks side by side (q | k | v of a fused QKV
                            projection); each block is cut t ways and rank r keeps piece r of each,
                            so its q, k and v belong to the same heads
    Split(dim=0, parts=3, sections=(a, g, g))
                            the same, with blocks of unequal length in the ratio a : g : g (grouped-query
                            attention: a query heads, g key-value heads); each block is still cut t ways

    Split(dim=0, size=V)    a vocabulary of V words, padded with zero rows up to a multiple of t when it
                            does not divide (Megatron-LM's `make_vocab_size_divisible_by`): rank r keeps
                            rows r*V'/t .. of the padded V'; the padding is cut away again on joining

The same object cuts a full tensor (when a model is parallelized, and when a full checkpoint is loaded)
and joins the t pieces (`full_state_dict`, saving a full checkpoint), so the two are exact inverses and a
checkpoint moves between layouts bit for bit, padded or not. A parameter that is not split (a layer norm,
a bias added after a reduction) is replicated: every rank holds it whole.

Padding. Megatron pads the vocabulary to a multiple of 128·t (its default `make_vocab_size_divisible_by`
128, for the GEMMs' tiles) and lets the padding rows train like any others, so its loss counts V' - V words
no text contains. The toolkit pads to the least multiple of t (nothing to gain from tiles on a CPU), and its
vocabulary-parallel loss leaves the padding out (`cross_entropy.py`): the padding rows get no gradient,
stay zero, and a padded run computes exactly what one unpadded process computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Split:
    dim: int
    parts: int = 1
    size: int | None = None  # a vocabulary's length: padded up to a multiple of t (None: it must divide)
    sections: tuple[int, ...] | None = None  # the blocks' lengths relative to each other (None: equal)

    def blocks(self, size: int) -> list[int]:
        """The lengths of the `parts` blocks of a dimension of `size`."""
        sections = self.sections or (1,) * self.parts
        return [size * s // sum(sections) for s in sections]

    def check(self, size: int, tp: int, what: str) -> None:
        """A clear error when a dimension of `size` does not cut into t equal pieces (per block)."""
        if self.size is not None or (
            size % sum(self.sections or (self.parts,)) == 0 and all(b % tp == 0 for b in self.blocks(size))
        ):
            return
        block = min(self.blocks(size))
        fits = [t for t in range(1, block + 1) if block % t == 0]
        pad = -(-block // tp) * tp
        raise ValueError(
            f"tensor parallelism: {what} = {block}{' per block' if self.parts > 1 else ''} does not "
            f"split over tp={tp} ranks. Choose a tp that divides it (one of {fits}), or pad it to a "
            f"multiple of {tp} (e.g. {pad})."
        )

    def padded(self, tp: int) -> int:
        """The vocabulary's length once padded for t ranks: the least multiple of t that holds it."""
        return -(-self.size // tp) * tp

    def full_size(self, piece_size: int, tp: int) -> int:
        """The length of the split dimension in the full tensor, from one piece's."""
        return piece_size * tp if self.size is None else self.size

    def shard(self, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
        """This rank's piece of `full` (a new tensor)."""
        if self.size is not None and full.shape[self.dim] != self.padded(tp):  # zero rows after the last word
            shape = list(full.shape)
            shape[self.dim] = self.padded(tp) - full.shape[self.dim]
            full = torch.cat([full, full.new_zeros(shape)], dim=self.dim)
        blocks = full.split(self.blocks(full.shape[self.dim]), dim=self.dim)
        return torch.cat([b.chunk(tp, dim=self.dim)[rank] for b in blocks], dim=self.dim).clone()

    def join(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's piece, in tensor-parallel rank order (a vocabulary's padding cut)."""
        per_rank = [p.split(self.blocks(p.shape[self.dim]), dim=self.dim) for p in pieces]
        full = torch.cat(
            [torch.cat([mine[b] for mine in per_rank], dim=self.dim) for b in range(self.parts)], dim=self.dim
        )
        return full if self.size is None else full.narrow(self.dim, 0, self.size)


ROWS, COLUMNS, QKV_ROWS = Split(0), Split(1), Split(0, parts=3)


def qkv_rows(n_head: int, n_kv_head: int) -> Split:
    """How a fused [q | k | v] projection splits: QKV_ROWS, or blocks in the ratio n_head : n_kv_head : n_kv_head."""
    return QKV_ROWS if n_kv_head == n_head else Split(0, parts=3, sections=(n_head, n_kv_head, n_kv_head))


def mark(param: torch.nn.Parameter, split: Split | None) -> torch.nn.Parameter:
    """Tag a parameter with how it is split (None: replicated). Strategies carry the tag along."""
    param._tp_split = split
    return param


def split_of(param) -> Split | None:
    return getattr(param, "_tp_split", None)
