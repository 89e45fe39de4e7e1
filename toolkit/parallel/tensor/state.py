"""The full model from the tensor-parallel pieces, and the pieces from a full model.

`parallelize` remembers, by parameter name, how each parameter is split (`shards.Split`, or None for a
replicated one). That is all a layout-free view needs:

    gather(state)  every split entry all-gathered over the tensor-parallel group and joined: the full
                   tensors under the original names, on every rank (`toolkit.parallel.full_state_dict`)
    shard(state)   every split entry cut to this rank's piece (loading a full checkpoint)

Both act on anything keyed by parameter name whose tensors have the parameter's shape: the parameters,
and an optimizer's per-parameter state (Adam's moments), so a checkpoint moves between (dp, tp) layouts
bit for bit (`checkpoint.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ... import comm
from .operators import TPGroup
from .shards import Split


@dataclass
class TensorParallel:
    """What a tensor-parallel model carries (`model.tensor_parallel`): its group and how each parameter is split."""

    tp: TPGroup
    splits: dict = field(default_factory=dict)  # parameter name -> Split (None: replicated)
    sequence_parallel: bool = False
    plan: dict = field(default_factory=dict)

    def is_split(self, name: str) -> bool:
        return self.splits.get(name) is not None

    @torch.no_grad()
    def gather_tensor(self, name: str, piece: torch.Tensor) -> torch.Tensor:
        split: Split | None = self.splits.get(name)
        if split is None or self.tp.size == 1:
            return piece
        everyone = piece.new_empty((self.tp.size,) + tuple(piece.shape))
        comm.all_gather(everyone, piece.contiguous(), group=self.tp.group)
        return split.join(list(everyone.unbind(0)))

    def gather(self, state: dict) -> dict:
        """{name: full tensor} from {name: this rank's piece}; every rank of the group must call it."""
        return {name: self.gather_tensor(name, t) if _shaped(t) else t for name, t in state.items()}

    def shard_tensor(self, name: str, full: torch.Tensor) -> torch.Tensor:
        split: Split | None = self.splits.get(name)
        if split is None or self.tp.size == 1:
            return full
        return split.shard(full, self.tp.size, self.tp.rank)

    def shard(self, state: dict) -> dict:
        return {name: self.shard_tensor(name, t) if _shaped(t) else t for name, t in state.items()}

    def describe(self) -> list[dict]:
        """One row per parameter: name, how it is split (or 'replicated')."""
        return [
            {
                "param": n,
                "split": "replicated"
                if s is None
                else f"dim {s.dim}"
                + (f" ({s.parts} blocks)" if s.parts > 1 else "")
                + (
                    f" (padded to {s.padded(self.tp.size)})"
                    if s.size is not None and s.padded(self.tp.size) != s.size
                    else ""
                ),
            }
            for n, s in self.splits.items()
        ]


def _shaped(t) -> bool:
    return torch.is_tensor(t) and t.dim() > 0
