"""The vocabulary split over the tensor-parallel ranks: the embedding table and, tied to it, the head.

The token embedding (V, h) and the output head (V, h) are often the largest matrices of a small model,
and the logits (b, s, V) the largest activation. Megatron cuts both along the vocabulary: rank r holds
rows r·V/t .. (r+1)·V/t - 1.

Embedding: a rank looks up the tokens whose ids fall in its rows and writes zeros for the others; the
t partial tables add up to the real lookup (g: one all-reduce of b·s·h). The ids need no gradient, so
no f in front. Under sequence parallelism the next layer wants only this rank's s/t positions, so the
partial lookups are reduce-scattered along the sequence instead: the same sum, each rank keeping its
part, for half an all-reduce's bytes ((t-1)/t·b·s·h instead of 2(t-1)/t·b·s·h). Megatron-LM does this
(`reduce_scatter_embeddings`) when the model has no learned position embedding; the toolkit GPT has one,
and adds each rank's own positions after the reduce-scatter (`gpt.py`).

Head: a column-parallel layer over the vocabulary (`linear.py`), so rank r computes the logits of its
V/t words only, and the loss is computed on them where they lie (`cross_entropy.py`): no rank ever
holds the full (b, s, V) logits. With a tied head the embedding and the head share one Parameter, and
because both are cut by vocabulary rows, they share this rank's piece too. A vocabulary that does not
divide by t is padded with zero rows to the next multiple (`shards.py`); no token id reaches them, and the
loss leaves their logits out.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .linear import split_parameter
from .operators import TPGroup, reduce_from_tp, reduce_scatter_sequence
from .shards import Split


class VocabParallelEmbedding(nn.Module):
    """An nn.Embedding whose rows are split over the tensor-parallel group; forward as the original's, or under
    sequence_parallel this rank's part of the sequence (dim 1) of it."""

    def __init__(
        self, module: nn.Embedding, tp: TPGroup, done: dict, name: str = "", *, sequence_parallel: bool = False
    ):
        super().__init__()
        if module.padding_idx is not None or module.max_norm is not None or module.sparse:
            raise ValueError(
                f"tensor parallelism: embedding {name!r} uses padding_idx, max_norm or sparse "
                f"gradients, which the vocabulary-parallel embedding does not support; plan it "
                f"'replicate'."
            )
        self.tp, self.name, self.sequence_parallel = tp, name, sequence_parallel
        self.num_embeddings, self.embedding_dim = module.num_embeddings, module.embedding_dim
        self.weight = split_parameter(
            module.weight, Split(0, size=module.num_embeddings), tp, done, f"the vocabulary of {name!r}"
        )  # padded to a multiple of t (`shards.py`)
        rows = self.weight.shape[0]
        self.vocab_start, self.vocab_end = tp.rank * rows, (tp.rank + 1) * rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)  # any row: it is zeroed next
        partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:  # the sum, this rank's positions of it
            return reduce_scatter_sequence(partial, self.tp)
        return reduce_from_tp(partial, self.tp)  # g: the t partial lookups add up

    def extra_repr(self) -> str:
        return (
            f"rows {self.vocab_start}..{self.vocab_end - 1} of {self.num_embeddings}, dim={self.embedding_dim}, "
            f"tp={self.tp.size}" + (", sequence parallel" if self.sequence_parallel else "")
        )
