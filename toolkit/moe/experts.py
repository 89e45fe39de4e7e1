"""The experts of an MoE layer: E feed-forward networks, of which this rank holds its share.

Expert parallelism splits the E experts over the W ranks of a group: rank r holds experts
r*E/W .. (r+1)*E/W - 1 (its *local* experts). Three choices here make that split invisible to the
mathematics, which is what lets one process holding all experts serve as the reference:

1. Batched weights. The local experts' weights live in one tensor per kind, (E_local, d_model, d_ff)
   and so on, so a rank's experts are four parameters whatever E_local is.
2. Layout-independent initialization. Global expert i draws its weights from a generator seeded by
   (seed, i), never from torch's global RNG, so with the same seed expert i has the same weights at
   any expert-parallel size, and building the layer consumes no global randomness.
3. Tags. Every expert parameter carries ``param._toolkit_expert = True``: data-parallel strategies
   must not average it with the other ranks' (they hold *other* experts). ``gather_experts``
   collects them under global names (``experts.{i}.w1``) for a full, layout-free state dict.

With more ranks than experts (W > E, Tutel's EP+DP+MP, ``moe/sharded.py``) a rank holds one slice of
one expert: ``shard=(k, s)`` keeps slice k of s of the hidden layer (d_ff/s columns of w1 and b1, rows
of w2) and of the output bias b2 (ceil(d_model/s) entries, the last slice padded), cut from the same
layout-independent weights.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .. import comm
from ..comm.average import divide_factors

WEIGHTS = ("w1", "b1", "w2", "b2")  # x @ w1 + b1 -> GELU -> @ w2 + b2


def is_expert(param) -> bool:
    """True for parameters that belong to one rank's experts (data parallelism must skip them)."""
    return bool(getattr(param, "_toolkit_expert", False))


def expert_generator(seed: int, index: int) -> torch.Generator:
    """A CPU generator that depends only on (seed, global expert index): the layout-free init."""
    digest = hashlib.sha256(f"toolkit.moe/{int(seed)}/{int(index)}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


class Experts(nn.Module):
    """The FFN experts ``first .. first + num_local - 1`` out of ``num_experts``, as batched weights.

    ``forward(x, counts)`` takes rows already grouped by local expert (``counts[e]`` rows for
    expert e, in order) and returns each row's expert output, in the same order.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        num_experts: int,
        first: int,
        num_local: int,
        *,
        seed: int = 0,
        init_std: float = 0.02,
        group=None,
        shard=(0, 1),
    ):
        super().__init__()
        self.d_model, self.d_ff, self.num_experts = d_model, d_ff, num_experts
        self.first, self.num_local, self.seed, self.group = first, num_local, seed, group
        self.shard = tuple(shard)  # (k, s): slice k of s of each expert (W > E); (0, 1): whole experts
        f, b = d_ff // self.shard[1], -(-d_model // self.shard[1])
        shapes = {"w1": (d_model, f), "b1": (f,), "w2": (f, d_model), "b2": (b,)}
        for name, shape in shapes.items():
            p = nn.Parameter(torch.zeros(num_local, *shape))
            p._toolkit_expert = True
            setattr(self, name, p)
        self.reset_parameters(init_std)

    @torch.no_grad()
    def reset_parameters(self, init_std: float = 0.02) -> None:
        """Weights ~ N(0, init_std) from each global expert's own generator, biases zero."""
        if self.w1.is_meta:  # built on meta (a simulated cluster): shapes only, no values to draw
            return
        k, s = self.shard
        f = self.d_ff // s
        for e in range(self.num_local):
            g = expert_generator(self.seed, self.first + e)
            w1 = torch.randn(self.d_model, self.d_ff, generator=g) * init_std  # drawn in this order for
            w2 = torch.randn(self.d_ff, self.d_model, generator=g) * init_std  # every expert, every layout
            self.w1[e].copy_(w1[:, k * f : (k + 1) * f])
            self.w2[e].copy_(w2[k * f : (k + 1) * f])
        self.b1.zero_()
        self.b2.zero_()

    def extra_repr(self) -> str:
        last = self.first + self.num_local - 1
        sliced = f", slice {self.shard[0]} of {self.shard[1]}" if self.shard[1] > 1 else ""
        return (
            f"experts {self.first}..{last} of {self.num_experts}{sliced}, d_model={self.d_model}, "
            f"d_ff={self.d_ff}, seed={self.seed}"
        )

    def expert(self, e: int, x: torch.Tensor, weights=None) -> torch.Tensor:
        """Local expert e on rows x: the dense MLP, d_model -> d_ff -> GELU -> d_model."""
        w1, b1, w2, b2 = weights or (self.w1, self.b1, self.w2, self.b2)
        return F.gelu(x @ w1[e] + b1[e]) @ w2[e] + b2[e]

    def forward(self, x: torch.Tensor, counts) -> torch.Tensor:
        chunks = x.split([int(c) for c in counts])
        if len(chunks) != self.num_local:
            raise ValueError(f"Experts.forward needs one count per local expert ({self.num_local}), got {len(chunks)}.")
        weights = tuple(predivided(getattr(self, n)) for n in WEIGHTS)  # fp16 under an average: see below
        return torch.cat([self.expert(e, chunk, weights) for e, chunk in enumerate(chunks)])


def gather_experts(model: nn.Module, state: dict) -> dict:
    """``state`` with every Experts module's local, batched entries replaced by global ones.

    ``blocks.0.mlp.experts.w1`` of shape (E_local, d, d_ff) on each rank becomes
    ``blocks.0.mlp.experts.{i}.w1`` of shape (d, d_ff) for every global expert i, gathered from the
    ranks that hold them (an all-gather over the experts' group, through the door). Every rank of
    that group must call it. ``state`` may be keyed relative to ``model`` or to its ``.module``
    (what a strategy's wrapper holds). Entries of other modules pass through unchanged.
    """
    out = dict(state)
    for path, m in model.named_modules():
        if hasattr(m, "gather_state"):  # another layout of experts (moe/hf.py: a Hugging Face model's fused ones)
            m.gather_state(path, out)
            continue
        if not isinstance(m, Experts):
            continue
        prefix = next((p for p in (path, path.removeprefix("module.")) if f"{p}.w1" in out), None)
        if prefix is None:
            continue
        s = m.shard[1]
        for name in WEIGHTS:
            local = out.pop(f"{prefix}.{name}")
            everyone = local
            if dist.is_initialized() and (m.num_local < m.num_experts or s > 1):
                everyone = local.new_empty((m.num_experts * s,) + tuple(local.shape[1:]))
                comm.all_gather(everyone, local.contiguous(), group=m.group)
            everyone = join_slices(everyone, name, s, m.d_model)
            for i in range(m.num_experts):
                out[f"{prefix}.{i}.{name}"] = everyone[i].clone()
    return out


def join_slices(stacked: torch.Tensor, name: str, s: int, d_model: int) -> torch.Tensor:
    """(E*s, slice shape) -> (E, whole shape): the s slices of each expert side by side (hidden columns
    of w1, entries of b1, rows of w2; b2's entries, trimmed to d_model). Differentiable; s = 1: as is."""
    if s == 1:
        return stacked
    E = stacked.shape[0] // s
    parts = stacked.reshape((E, s) + tuple(stacked.shape[1:]))
    if name == "w1":  # (E, s, d, f) -> (E, d, s*f)
        return parts.permute(0, 2, 1, 3).reshape(E, parts.shape[2], -1)
    whole = parts.reshape((E, -1) + tuple(parts.shape[3:]))
    return whole[:, :d_model] if name == "b2" else whole


# --- fp16 expert gradients under a data-parallel average ------------------------------------------------
# An expert's gradient is the sum of every rank's contribution (the rows it computed came from every rank;
# under Tutel's placements a reduce-scatter, under shadowing an all-reduce adds them up), and the strategy
# then averages it over N (parallel/ddp.py). In fp16 that sum can overflow 65504 where the average fits.
# So, as torch FSDP divides its gradients before their reduce-scatter (comm/average.py), every contribution
# is divided by ``pre`` before it is summed over the ranks, and the strategy divides by N / pre after. The
# strategy says N by tagging its expert parameters ``_toolkit_grad_average``; without one, nothing changes.
# In the experts' own backward the division comes right after the matrix product that adds up the rows,
# which has already summed in fp16 (as in Tutel and DeepSpeed-MoE): see docs/differences.md.


def predivide_factor(params, dtype) -> float:
    """``pre`` for ``params``' gradient contributions in ``dtype`` (1: nothing to divide)."""
    n = getattr(params[0], "_toolkit_grad_average", None) if params else None
    return divide_factors(n, dtype)[0] if n else 1.0


def predivide(contribution: torch.Tensor, params) -> torch.Tensor:
    """``contribution`` (to ``params``' gradients) divided by ``pre``, before a collective sums it."""
    pre = predivide_factor(params, contribution.dtype)
    return contribution if pre == 1 else contribution / pre


def predivided(p: torch.Tensor) -> torch.Tensor:
    """Expert parameter ``p`` as used where its own backward makes the contribution (no collective sums it
    after): its gradient is divided by ``pre`` on the way, like every other contribution."""
    from ..parallel.scaler import _ScaleGrad  # identity forward; backward multiplies (by 1/pre, a power of 2)

    pre = predivide_factor((p,), p.dtype)
    return p if pre == 1 or not (p.requires_grad and torch.is_grad_enabled()) else _ScaleGrad.apply(p, 1.0 / pre)


class GatherWeights(torch.autograd.Function):
    """Weights travel: forward, every rank's flat ``flat`` rank after rank (an all-gather over ``group``);
    backward, the gradient summed over the ranks, each keeping its own slice (a reduce-scatter). Used by
    Tutel's data-parallel placement (every expert everywhere) and EP+DP+MP (an expert's slices).
    ``params``: the parameters ``flat`` is made of (in fp16 their contributions are predivided, see above)."""

    @staticmethod
    def forward(ctx, flat, group, world, label, params=()):
        ctx.group, ctx.numel, ctx.label, ctx.params = group, flat.numel(), label, params
        out = flat.new_empty(world * flat.numel())
        _label(comm.all_gather(out, flat.contiguous(), group=group, async_op=True), label).wait()
        return out

    @staticmethod
    def backward(ctx, grad):
        mine = grad.new_empty(ctx.numel)
        grad = predivide(grad.contiguous(), ctx.params)
        _label(
            comm.reduce_scatter(mine, grad, op="sum", group=ctx.group, async_op=True), ctx.label + " backward"
        ).wait()
        return mine, None, None, None, None


def _label(handle, label: str):
    handle.event["args"]["moe"] = label
    return handle
