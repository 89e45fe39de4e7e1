"""A synthetic corpus made in code: no downloads, same tokens on every machine.

The text is a random sparse Markov chain: each token may be followed by only a
few tokens (``branching``), with fixed random probabilities. A tiny GPT learns
that table in a few hundred steps, so its loss falls visibly from log(vocab_size)
towards ``entropy_floor()``, the best loss any model can reach.

Batches are a pure function of (seed, step, global batch size). That is what
makes data parallelism checkable: rank r of N takes the r-th contiguous slice
of the global batch, so N ranks together see exactly what one process sees.
"""

from __future__ import annotations

import hashlib
import math

import torch


def _generator(*keys: int) -> torch.Generator:
    """A torch RNG seeded from the keys; the same keys give the same stream on every machine."""
    digest = hashlib.sha256(":".join(str(k) for k in keys).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


class SyntheticCorpus:
    """Token sequences from a random sparse Markov chain.

    ``batch(step, global_batch_size)`` returns ``(x, y)``, both (global_batch_size, seq_len)
    int64, with ``y`` = ``x`` shifted left by one token. With ``rank`` and ``world_size`` it
    returns that rank's contiguous slice of the same global batch.
    """

    def __init__(self, vocab_size: int = 64, seq_len: int = 32, seed: int = 0, branching: int = 4):
        _check_positive_int("vocab_size", vocab_size)
        _check_positive_int("seq_len", seq_len)
        _check_positive_int("branching", branching)
        if branching > vocab_size:
            raise ValueError(f"branching={branching} cannot exceed vocab_size={vocab_size}")
        self.vocab_size, self.seq_len, self.seed, self.branching = vocab_size, seq_len, seed, branching
        self.transition = self._make_transition()  # (V, V) float64, row i = P(next | current = i)
        self._cdf = self.transition.cumsum(dim=1)  # float64: its last positive entry is ~1 > any u

    def _make_transition(self) -> torch.Tensor:
        V, g = self.vocab_size, _generator("transition", self.seed)
        P = torch.zeros(V, V, dtype=torch.float64)
        for token in range(V):
            successors = torch.randperm(V, generator=g)[: self.branching]
            weights = -torch.rand(self.branching, generator=g, dtype=torch.float64).clamp_min(1e-12).log()
            P[token, successors] = weights / weights.sum()  # Dirichlet(1, ..., 1) probabilities
        return P

    def batch(
        self,
        step: int,
        global_batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch for ``step``: a pure function of (seed, step, global_batch_size).

        With ``world_size`` > 1, rank ``rank`` gets rows [rank*b, (rank+1)*b) where
        b = global_batch_size // world_size, so concatenating the ranks' slices in rank
        order gives the full batch.
        """
        _check_positive_int("global_batch_size", global_batch_size)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        _check_rank(rank, world_size, global_batch_size)
        g = _generator("batch", self.seed, step, global_batch_size)
        B, T = global_batch_size, self.seq_len
        tokens = torch.empty(B, T + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab_size, (B,), generator=g)  # uniform first token
        u = torch.rand(T, B, 1, generator=g, dtype=torch.float64)  # one uniform per sampled token
        for t in range(T):
            cdf = self._cdf[tokens[:, t]]  # (B, V)
            nxt = torch.searchsorted(cdf, u[t], right=True).squeeze(1)  # inverse-CDF sampling
            tokens[:, t + 1] = nxt.clamp_max(self.vocab_size - 1)
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        if world_size > 1:
            x, y = self.shard(x, y, rank, world_size)
        if device is not None:
            x, y = x.to(device), y.to(device)
        return x, y

    @staticmethod
    def shard(x: torch.Tensor, y: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s contiguous slice of a global batch (rows split evenly, in rank order)."""
        _check_rank(rank, world_size, x.shape[0])
        b = x.shape[0] // world_size
        return x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]

    def entropy_floor(self) -> float:
        """The best achievable mean loss (nats per token) on this corpus's batches.

        The next token depends only on the current one, so the ideal model predicts
        ``transition[current]`` and pays its entropy H_i. Position t's current token is
        distributed as p_t = p_0 P^t (p_0 uniform), so the floor is mean_t sum_i p_t(i) H_i.
        """
        P = self.transition
        row_entropy = -(P * P.clamp_min(1e-300).log()).sum(dim=1)  # H_i, nats
        p = torch.full((self.vocab_size,), 1.0 / self.vocab_size, dtype=torch.float64)
        total = 0.0
        for _ in range(self.seq_len):
            total += float(p @ row_entropy)
            p = p @ P
        return total / self.seq_len

    def uniform_loss(self) -> float:
        """The loss of a model that knows nothing: log(vocab_size) nats per token."""
        return math.log(self.vocab_size)

    def __repr__(self) -> str:
        return (
            f"SyntheticCorpus(vocab_size={self.vocab_size}, seq_len={self.seq_len}, seed={self.seed}, "
            f"branching={self.branching})"
        )


def _check_rank(rank, world_size, global_batch_size: int) -> None:
    _check_positive_int("world_size", world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in 0..{world_size - 1} for world_size={world_size}, got {rank!r}")
    if global_batch_size % world_size != 0:
        raise ValueError(
            f"global batch size {global_batch_size} does not divide evenly over world_size={world_size}; "
            f"use a multiple of {world_size} (for example {world_size * max(1, global_batch_size // world_size)})"
        )
