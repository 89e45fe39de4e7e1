"""A tiny GPT: the model every strategy in the toolkit trains.

Small enough to train on a laptop CPU in seconds, real enough to show where the
bytes go: embeddings, attention, an MLP per block and a (tied) output head.
Two things make it a good test subject for distributed training:

* it is deterministic: no dropout unless asked for (``GPTConfig.dropout``,
  ``attention_dropout``), and the weights depend only on ``torch.manual_seed``,
  so a sharded run can be checked against one process;
* the MLP of each block is pluggable, so a Mixture-of-Experts layer
  (``toolkit.moe.MoE``) drops in without touching this file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

INIT_STD = 0.02


@dataclass
class GPTConfig:
    """Shape of the model. Dropout is off by default, so that runs are reproducible across layouts."""

    vocab_size: int = 64
    seq_len: int = 32  # the longest sequence the position embedding covers
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 32
    n_kv_head: int | None = None  # key-value heads (grouped-query attention, Llama 2 70B/3); None means n_head
    d_ff: int | None = None  # hidden width of the MLP; None means 4 * d_model
    tied_head: bool = True  # the output head reuses the token embedding matrix
    aux_loss_weight: float = 0.01  # weight of the blocks' auxiliary losses (MoE load balancing)
    dropout: float = 0.0  # GPT-2's hidden dropout: after the embeddings and on each residual branch
    attention_dropout: float = 0.0  # dropout of the attention weights

    def __post_init__(self):
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        for name in ("dropout", "attention_dropout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ValueError(f"GPTConfig.{name} is a probability in [0, 1), got {value!r}")
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_kv_head", "d_model", "d_ff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head != 0:
            divisors = [h for h in range(1, self.d_model + 1) if self.d_model % h == 0]
            raise ValueError(
                f"GPTConfig: d_model={self.d_model} must divide evenly into n_head={self.n_head} heads; "
                f"valid n_head for this d_model: {divisors}"
            )
        if self.n_head % self.n_kv_head != 0:
            groups = [g for g in range(1, self.n_head + 1) if self.n_head % g == 0]
            raise ValueError(
                f"GPTConfig: n_head={self.n_head} query heads must share n_kv_head={self.n_kv_head} key-value heads "
                f"equally (grouped-query attention); valid n_kv_head for this n_head: {groups}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_width(self) -> int:
        """Features of K (and of V): n_kv_head heads of head_dim; d_model without grouped-query attention."""
        return self.n_kv_head * self.head_dim


def repeat_kv(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """(B, kv heads, T, head_dim) -> (B, n_head, T, head_dim): each key-value head repeated for the n_head/kv
    query heads that share it (grouped-query attention; transformers' `repeat_kv`); x itself when none share."""
    groups = n_head // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def init_weights_(module: nn.Module) -> None:
    """GPT-2 style init of the Linear and Embedding layers inside ``module``:
    weights ~ N(0, 0.02), biases zero. LayerNorms keep PyTorch's ones/zeros."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=INIT_STD)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)


class CausalSelfAttention(nn.Module):
    """Multi-head attention where a token sees only itself and the tokens before it.

    With grouped-query attention (``n_kv_head < n_head``) K and V have n_kv_head heads, each shared by
    n_head/n_kv_head query heads; they stay that small until ``attend`` repeats them, so whatever moves them
    (context parallelism's ring) moves the compact ones."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.qkv = nn.Linear(config.d_model, config.d_model + 2 * config.kv_width)  # q, k, v in one matmul
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.attention_dropout = config.attention_dropout
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.attend(*self.heads(self.qkv(x), self.n_head, self.n_kv_head))
        B, heads, T, head_dim = y.shape
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, heads * head_dim)))

    @staticmethod
    def heads(qkv: torch.Tensor, n_head: int, n_kv_head: int):
        """q (B, n_head, T, head_dim), k and v (B, n_kv_head, T, head_dim) from the fused projection's output."""
        B, T, width = qkv.shape
        head_dim = width // (n_head + 2 * n_kv_head)
        q, k, v = qkv.split([n_head * head_dim, n_kv_head * head_dim, n_kv_head * head_dim], dim=-1)
        return (t.view(B, T, -1, head_dim).transpose(1, 2) for t in (q, k, v))

    def dropout_p(self) -> float:
        """The attention weights' dropout now (none when evaluating)."""
        return self.attention_dropout if self.training else 0.0

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention itself, on (B, heads, T, head_dim) tensors: the one place context parallelism
        (toolkit.parallel.context) replaces, with the ranks' tokens passed around a ring. k and v may have fewer
        heads than q (grouped-query attention): they are repeated here, at the point of use."""
        k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout_p())


class MLP(nn.Module):
    """The dense feed-forward layer: d_model -> d_ff -> GELU -> d_model."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.d_ff)
        self.proj = nn.Linear(config.d_ff, config.d_model)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x)).

    ``mlp`` replaces the dense MLP (None builds the dense one). It maps
    (..., d_model) -> (..., d_model) and may return ``(output, aux_loss)``,
    as a Mixture-of-Experts layer does. A plugged-in mlp keeps its own
    initialization; the block only initializes what it builds.

    ``forward`` returns ``(x, aux_loss)``; ``aux_loss`` is None for a dense MLP.
    """

    def __init__(self, config: GPTConfig, mlp: nn.Module | None = None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config) if mlp is None else mlp
        init_weights_(self.attn)
        if mlp is None:
            init_weights_(self.mlp)

    def forward(self, x: torch.Tensor):
        x = x + self.attn(self.ln_1(x))
        out = self.mlp(self.ln_2(x))
        aux_loss = None
        if isinstance(out, tuple):
            out, aux_loss = out
        return x + out, aux_loss


def _build_mlp(mlp_factory, layer_index: int) -> nn.Module:
    mlp = mlp_factory(layer_index)
    if not isinstance(mlp, nn.Module):
        raise ValueError(f"mlp_factory({layer_index}) must return an nn.Module, got {type(mlp).__name__}")
    return mlp


class GPT(nn.Module):
    """Token + position embeddings, ``n_layer`` blocks, a final LayerNorm and a linear head.

    ``model(x)`` returns logits (B, T, vocab_size); ``model(x, y)`` returns the mean
    cross-entropy loss (plus ``aux_loss_weight`` times the blocks' auxiliary losses),
    so the plain loop ``loss = model(x, y); loss.backward()`` trains it.

    ``mlp_factory(layer_index)``, if given, builds the MLP of each block (see ``Block``).
    """

    def __init__(self, config: GPTConfig, mlp_factory: Callable[[int], nn.Module] | None = None):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        init_weights_(self.tok_emb)
        init_weights_(self.pos_emb)
        self.blocks = nn.ModuleList(
            Block(config, mlp=None if mlp_factory is None else _build_mlp(mlp_factory, i))
            for i in range(config.n_layer)
        )
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tied_head:
            self.head.weight = self.tok_emb.weight  # one Parameter, two users
        else:
            init_weights_(self.head)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(x)
        aux_losses = []
        for block in self.blocks:
            h, aux = block(h)
            if aux is not None:
                aux_losses.append(aux)
        if y is None:
            return self.head_loss(h, None)
        loss = self.head_loss(h, y)
        return loss + self.aux_loss(aux_losses) if aux_losses else loss

    # The three parts of forward, which pipeline parallelism runs on different ranks (toolkit.parallel.pipeline):
    # embed on the first stage, blocks spread over the stages, head_loss on the last.
    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Token + position embeddings of token ids x (batch, time): the hidden state (batch, time, d_model)."""
        if x.dim() != 2:
            raise ValueError(f"GPT expects token ids of shape (batch, time), got shape {tuple(x.shape)}")
        T = x.shape[1]
        if T > self.config.seq_len:
            raise ValueError(
                f"sequence length {T} is longer than the model's seq_len={self.config.seq_len}; "
                "shorten the input or build the model with a larger GPTConfig.seq_len"
            )
        return self.drop(self.tok_emb(x) + self.pos_emb(torch.arange(T, device=x.device)))

    def hidden_shape(self, x_shape) -> tuple:
        """The shape of the hidden state between blocks for token ids of shape x_shape (what embed returns)."""
        return (x_shape[0], x_shape[1], self.config.d_model)

    def head_loss(self, h: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        """The final norm and the head: logits when y is None, else the mean cross-entropy against y."""
        logits = self.head(self.ln_f(h))
        if y is None:
            return logits
        if y.shape != logits.shape[:-1]:
            raise ValueError(f"targets y must have the shape of x {tuple(logits.shape[:-1])}, got {tuple(y.shape)}")
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def aux_loss(self, aux_losses: list) -> torch.Tensor:
        """The blocks' auxiliary losses (MoE load balancing), weighted as they enter the loss."""
        aux = sum(aux_losses)
        if aux.dim() != 0:
            raise ValueError(f"an mlp's aux_loss must be a scalar tensor, got shape {tuple(aux.shape)}")
        return self.config.aux_loss_weight * aux

    def num_params(self) -> int:
        """Number of distinct parameters (a tied head is counted once)."""
        return sum(p.numel() for p in self.parameters())
