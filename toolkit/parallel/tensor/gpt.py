"""The toolkit GPT's default tensor-parallel plan: Megatron-LM's layout, with sequence parallelism on request.

    tok_emb              vocabulary-parallel embedding (rows by vocabulary; g after the lookup, or under sequence
                         parallelism a reduce-scatter along the sequence)
    pos_emb              replicated
    blocks.*.ln_1, ln_2  replicated (sequence parallelism: on s/t positions, gradients summed)
    blocks.*.attn        split by heads: qkv column-parallel (q, k, v of this rank's heads), proj row-parallel
    blocks.*.mlp         dense: fc column-parallel, proj row-parallel; MoE: tokens shared out (`moe.py`)
    ln_f                 as ln_1
    head                 column-parallel over the vocabulary, tied to tok_emb: the same rows of one Parameter
    loss                 vocabulary-parallel cross-entropy: no rank holds the full logits

Dropout (`GPTConfig.dropout`, `attention_dropout`): the attention weights' on this rank's heads draws from
the tensor-parallel stream; the embeddings' and the residual branches' act on replicated activations and draw
from the default stream, the same masks on every rank, or under sequence parallelism on this rank's positions,
from the tensor-parallel stream (`toolkit/parallel/rng.py`).

One block costs two all-reduces of b·s·h forward (g after attention, g after the MLP) and two backward
(f before each), or under sequence parallelism their reduce-scatter/all-gather halves. The model's
forward is the GPT's, with the sequence split after the embeddings (sequence parallelism) and the loss
taken on the split logits.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ...models.gpt import GPT, MLP
from ...moe.layer import MoE
from ..rng import SplitDropout
from .attention import split_attention
from .cross_entropy import vocab_parallel_cross_entropy
from .embedding import VocabParallelEmbedding
from .linear import ColumnParallelLinear, RowParallelLinear
from .moe import split_moe
from .operators import TPGroup, gather_from_tp, scatter_to_tp
from .sequence import sum_gradients_over_tp


class TensorParallelGPT(GPT):
    """The GPT after `parallelize_gpt`: `embed` (+ the sequence split), the blocks, `head_loss`."""

    tp: TPGroup
    sequence_parallel: bool

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Token + position embeddings; under sequence parallelism, this rank's s/t positions of them."""
        T = x.shape[1]
        positions = self.pos_emb(torch.arange(T, device=x.device))
        if not self.sequence_parallel:
            return self.drop(self.tok_emb(x) + positions)
        if T % self.tp.size:
            raise ValueError(
                f"sequence_parallel splits the sequence over tp={self.tp.size} ranks: a sequence of "
                f"{T} tokens does not split; use a length that is a multiple of {self.tp.size}."
            )
        # the token lookups come reduce-scattered (this rank's T/t positions, `embedding.py`); add those positions'
        # embeddings: the position table is replicated, so backward all-gathers its T/t-row gradients (T·h values,
        # not b·T·h) and every rank holds its whole gradient
        return self.drop(self.tok_emb(x) + scatter_to_tp(positions, self.tp, 0))  # a SplitDropout: this rank's masks

    def hidden_shape(self, x_shape) -> tuple:
        """The hidden state between blocks: (batch, time, d_model), time split t ways under sequence parallelism."""
        T = x_shape[1] // self.tp.size if self.sequence_parallel else x_shape[1]
        return (x_shape[0], T, self.config.d_model)

    def head_loss(self, h: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        """The final norm, the vocabulary-parallel head and its loss (full logits only when y is None)."""
        logits = self.head(self.ln_f(h))  # (B, T, V/t): this rank's words (a padded vocabulary: V'/t)
        V = self.config.vocab_size
        if y is None:
            return gather_from_tp(logits, self.tp, -1)[..., :V]
        return vocab_parallel_cross_entropy(logits, y, self.tp, vocab=V)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        self.check_input(x, y)
        return super().forward(x, y)  # the GPT's: embed, the blocks, head_loss (this class's embed and head_loss)

    def check_input(self, x, y) -> None:
        if x.dim() != 2:
            raise ValueError(f"GPT expects token ids of shape (batch, time), got shape {tuple(x.shape)}")
        if x.shape[1] > self.config.seq_len:
            raise ValueError(f"sequence length {x.shape[1]} is longer than the model's seq_len={self.config.seq_len}")
        if y is not None and y.shape != x.shape:
            raise ValueError(f"targets y must have the shape of x {tuple(x.shape)}, got {tuple(y.shape)}")


def default_plan(model: GPT) -> dict:
    """The plan `parallelize_gpt` applies, in `tp_plan` spelling (what a student compares with torch's)."""
    plan = {
        "tok_emb": "vocab",
        "pos_emb": "replicate",
        "blocks.*.attn.qkv": "colwise (by heads)",
        "blocks.*.attn.proj": "rowwise",
        "head": "vocab (loss on split logits)",
    }
    if any(isinstance(b.mlp, MLP) for b in model.blocks):
        plan.update({"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"})
    if any(isinstance(b.mlp, MoE) for b in model.blocks):
        plan["blocks.*.mlp (MoE)"] = "tokens shared out, experts over the world"
    return plan


def parallelize_gpt(model: GPT, tp: TPGroup, sequence_parallel: bool) -> GPT:
    """Apply the default plan to a toolkit GPT, in place; parameter names do not change."""
    c = model.config
    unknown = [i for i, b in enumerate(model.blocks) if not isinstance(b.mlp, (MLP, MoE))]
    if unknown:
        raise ValueError(
            f"tensor parallelism: blocks {unknown} have an MLP of a kind the default plan does not know "
            f"({type(model.blocks[unknown[0]].mlp).__name__}); pass tp_plan= naming its Linear layers."
        )
    if c.n_head % tp.size or c.n_kv_head % tp.size:  # the first error a student meets: say it before anything is cut
        split_attention(model.blocks[0].attn, tp, {}, "blocks.0.attn", False)
    done: dict = {}
    model.tok_emb = VocabParallelEmbedding(model.tok_emb, tp, done, "tok_emb", sequence_parallel=sequence_parallel)
    for i, block in enumerate(model.blocks):
        split_attention(block.attn, tp, done, f"blocks.{i}.attn", sequence_parallel)
        if isinstance(block.mlp, MoE):
            split_moe(block.mlp, tp, sequence_parallel)
        else:
            block.mlp.fc = ColumnParallelLinear(
                block.mlp.fc, tp, done, f"blocks.{i}.mlp.fc", sequence_parallel=sequence_parallel
            )
            block.mlp.proj = RowParallelLinear(
                block.mlp.proj, tp, done, f"blocks.{i}.mlp.proj", sequence_parallel=sequence_parallel
            )
        if sequence_parallel:
            sum_gradients_over_tp(block.ln_1, tp)
            sum_gradients_over_tp(block.ln_2, tp)
            for dropout in (block.attn.resid_drop, getattr(block.mlp, "drop", None)):
                if isinstance(dropout, nn.Dropout):  # on this rank's positions: masks of their own
                    dropout.__class__ = SplitDropout
    if sequence_parallel:
        sum_gradients_over_tp(model.ln_f, tp)
        model.drop.__class__ = SplitDropout
    model.head = ColumnParallelLinear(model.head, tp, done, "head", sequence_parallel=sequence_parallel, vocab=True)
    model.__class__ = TensorParallelGPT
    model.tp, model.sequence_parallel = tp, sequence_parallel
    return model
