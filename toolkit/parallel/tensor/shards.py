"""Which piece of a full weight a tensor-parallel rank holds, and how the pieces join again.

A split layer keeps its parameters under their original names, with one dimension cut t ways:

    Split(dim=0)            rows r*n/t .. (r+1)*n/t - 1   (a column-parallel Linear's weight (out, in) and
                                                          bias, a vocabulary-parallel embedding (V, h))
    Split(dim=1)            columns                       (a row-parallel Linear's weight (out, in))
    Split(dim=0, parts=3)   the dimension is three blocks side by side (q | k | v of a fused QKV
                            projection); each block is cut t ways and rank r keeps piece r of each,
                            so its q, k and v belong to the same heads

The same object cuts a full tensor (when a model is parallelized, and when a full checkpoint is loaded)
and joins the t pieces (`full_state_dict`, saving a full checkpoint), so the two are exact inverses and a
checkpoint moves between layouts bit for bit. A parameter that is not split (a layer norm, a bias added
after a reduction) is replicated: every rank holds it whole.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Split:
    dim: int
    parts: int = 1

    def check(self, size: int, tp: int, what: str) -> None:
        """A clear error when a dimension of `size` does not cut into t equal pieces (per block)."""
        if size % (self.parts * tp) == 0:
            return
        block = size // self.parts
        fits = [t for t in range(1, block + 1) if block % t == 0]
        pad = -(-block // tp) * tp
        raise ValueError(f"tensor parallelism: {what} = {block}{' per block' if self.parts > 1 else ''} does not "
                         f"split over tp={tp} ranks. Choose a tp that divides it (one of {fits}), or pad it to a "
                         f"multiple of {tp} (e.g. {pad}).")

    def shard(self, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
        """This rank's piece of `full` (a new tensor)."""
        blocks = full.chunk(self.parts, dim=self.dim)
        return torch.cat([b.chunk(tp, dim=self.dim)[rank] for b in blocks], dim=self.dim).clone()

    def join(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's piece, in tensor-parallel rank order."""
        per_rank = [p.chunk(self.parts, dim=self.dim) for p in pieces]
        return torch.cat([torch.cat([mine[b] for mine in per_rank], dim=self.dim) for b in range(self.parts)],
                         dim=self.dim)

    def local_size(self, size: int, tp: int) -> int:
        return size // tp


ROWS, COLUMNS, QKV_ROWS = Split(0), Split(1), Split(0, parts=3)


def mark(param: torch.nn.Parameter, split: Split | None) -> torch.nn.Parameter:
    """Tag a parameter with how it is split (None: replicated). Strategies carry the tag along."""
    param._tp_split = split
    return param


def split_of(param) -> Split | None:
    return getattr(param, "_tp_split", None)
