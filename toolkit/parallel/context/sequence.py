"""Which tokens of a sequence each context-parallel rank holds: contiguous, or zigzag for causal balance.

Under causal attention a token attends to every token before it, so the work of a query grows with its
position. Split a sequence of s tokens into cp contiguous pieces and the last rank does cp times the first
rank's work: in a ring, the first rank idles most of the time while the last computes.

Megatron-LM (`get_batch_on_this_cp_rank`, TransformerEngine's attention with cp) and torch's context parallel
(its head-tail load balancer) cut the sequence into 2·cp chunks instead and give rank i chunks i and 2·cp-1-i:
an early chunk (little work) and its mirror image at the end (much work). Every rank then holds the same
amount of causal work. For cp = 2, s = 8 (chunks of 2 tokens):

    positions   0 1 | 2 3 | 4 5 | 6 7
    chunk         0     1     2     3
    zigzag      rank 0 holds chunks 0, 3 (positions 0 1 6 7), rank 1 chunks 1, 2 (positions 2 3 4 5)
    contiguous  rank 0 holds positions 0-3, rank 1 positions 4-7

Each rank reads the whole rows of its data-parallel replica (as every rank of a tensor-parallel group does)
and keeps its own tokens: inputs and labels alike, so a label stays beside its input. Position embeddings
must see the *global* position of each kept token (`positions`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SEQUENCE_DIM = 1  # token ids (batch, time); activations (batch, time, hidden)


@dataclass(frozen=True)
class SequenceSplit:
    """How a sequence is shared out among `cp` ranks, seen from rank `rank`; `zigzag` balances causal work."""

    cp: int
    rank: int
    zigzag: bool = True

    @property
    def num_chunks(self) -> int:
        return 2 * self.cp if self.zigzag else self.cp

    def chunks(self, rank: int | None = None) -> tuple[int, ...]:
        """The chunks (in sequence order) a rank holds: (i, 2cp-1-i) zigzag, (i,) contiguous."""
        i = self.rank if rank is None else rank
        return (i, 2 * self.cp - 1 - i) if self.zigzag else (i,)

    def check(self, length: int, what: str = "the sequence") -> None:
        """A sequence that does not split into whole chunks is an error that says which lengths do."""
        if length % self.num_chunks:
            how = (
                f"2·cp = {self.num_chunks} chunks (zigzag: rank i holds chunks i and 2·cp-1-i, so causal work "
                f"is balanced)"
                if self.zigzag
                else f"cp = {self.cp} contiguous pieces"
            )
            near = max(self.num_chunks, length - length % self.num_chunks)
            raise ValueError(
                f"context parallelism over cp={self.cp} ranks splits {what} into {how}: a length of "
                f"{length} tokens does not split. Use a multiple of {self.num_chunks} (e.g. {near} or "
                f"{near + self.num_chunks})."
            )

    def positions(self, length: int, device=None) -> torch.Tensor:
        """The global positions of this rank's tokens of a `length`-token sequence, in the order it holds them."""
        self.check(length)
        size = length // self.num_chunks
        return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in self.chunks()])

    def local(self, x: torch.Tensor, dim: int = SEQUENCE_DIM) -> torch.Tensor:
        """This rank's tokens of `x` (the whole sequence along `dim`)."""
        self.check(x.shape[dim])
        pieces = x.chunk(self.num_chunks, dim=dim)
        return torch.cat([pieces[c] for c in self.chunks()], dim=dim)

    def whole(self, pieces: list, dim: int = SEQUENCE_DIM) -> torch.Tensor:
        """The whole sequence from every rank's `local` tensor (`pieces[r]` is rank r's), in sequence order."""
        order = {}
        for r, piece in enumerate(pieces):
            for k, part in zip(self.chunks(r), piece.chunk(len(self.chunks(r)), dim=dim)):
                order[k] = part
        return torch.cat([order[k] for k in range(self.num_chunks)], dim=dim)
