"""Shadowing's steps 4-6, with its own traffic hidden behind computation (FasterMoE).

Shadowing adds work the plain layer does not have: the shadowed experts' weights travel out from
their owners (one broadcast each), every rank computes its rows for those experts at home on the
copies, and in backward the copies' gradients travel back to the owners, summed over the ranks. Done
one after another, each transfer waits its turn and nothing computes meanwhile; FasterMoE runs them
on their own CUDA streams. Here they are asynchronous collectives placed around the layer's own steps
4-6, whichever pattern runs them (one all-to-all each way, the smart schedule's per-peer steps,
Tutel's chunks: a ``toolkit.moe.schedule.Units``), in this order:

    forward                                             hides
      post the dispatch of the rows that travel
      post the broadcasts of the shadowed weights       (early)
      the local experts on the rows received            the broadcasts
      post the combine
      the shadowed experts on the rows kept home        the combine                 (late)
      wait for the combine
    backward
      post the combine's backward
      the shadowed experts' backward, rows kept home    the combine's backward      (early)
      post the all-reduce of the copies' gradients
      the local experts' backward, rows received        the all-reduce
      post the dispatch's backward, wait for it
      wait for the all-reduce; the owner adds the sum to its experts' gradients    (finish)

The door has no reduce, so the gradients' return is an all-reduce whose sum only the owner keeps.
Under an emulated link a rank's transfers still queue behind one another (one link), so what is won
is computing while transferring, never two transfers in the time of one.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .. import comm
from ..trace.events import span
from .experts import predivide
from .placement import ffn, run_experts
from .units import Units, label


class ShadowUnits(Units):
    """``inner`` (the layer's pattern for the rows that travel) plus the rows kept home.

    Its ``x`` holds every kept row, sorted by destination; ``home`` marks the rows of the shadowed
    experts (``home_counts[i]`` rows for ``shadowed[i]``, in order). The inner units see the others.
    """

    def __init__(self, inner: Units, layer, home: torch.Tensor, shadowed: list, home_counts: list):
        self.inner, self.count, self.layer = inner, inner.count, layer
        self.home_index, self.away_index = home.nonzero().squeeze(1), (~home).nonzero().squeeze(1)
        self.shadowed, self.home_counts = list(shadowed), list(home_counts)
        self.named = list(layer.experts.named_parameters())  # w1, b1, w2, b2 (E_local, ...), or theirs
        self.distributed = dist.is_initialized() and layer.world > 1
        self.differentiable = torch.is_grad_enabled()
        self.copies, self.broadcasts, self.result, self.saved, self.reduction = {}, [], None, None, None
        self._split = None  # (x, x's travelling rows) for the x being run

    # --- the rows that travel: the inner pattern's ----------------------------------------------
    def _away(self, x):
        if self._split is None or self._split[0] is not x:
            self._split = (x, x[self.away_index])
        return self._split[1]

    def post(self, x, k, names):
        return self.inner.post(self._away(x), k, names)

    def block(self, k, received):
        return self.inner.block(k, received)

    def post_back(self, k, y, names):
        return self.inner.post_back(k, y, names)

    def assemble(self, results, like):
        out = like.new_empty(like.shape)
        out[self.away_index] = self.inner.assemble(results, self._away(like))
        out[self.home_index] = self.result
        self._split = self.result = None
        return out

    # --- the rows kept home, alongside ------------------------------------------------------------
    def alongside(self, backward: bool) -> dict:
        if backward:
            return {"early": self.home_backward}
        return {"early": self.post_weights, "late": self.home_forward}

    def _owner(self, e):
        """(owner's position in the group, local index there)."""
        return divmod(e, self.layer.num_local)

    def post_weights(self, x):
        """Weights out: each shadowed expert's flat weights broadcast from its owner (asynchronous)."""
        ranks = comm.group_ranks(self.layer.group) if self.distributed else [0]
        for e in self.shadowed:
            owner, i = self._owner(e)
            if owner == self.layer.rank:
                flat = torch.cat([p[i].detach().reshape(-1) for _, p in self.named])
            else:
                flat = torch.empty(
                    sum(p[i].numel() for _, p in self.named),
                    dtype=self.named[0][1].dtype,
                    device=self.named[0][1].device,
                )
            if self.distributed:
                handle = comm.broadcast(flat, src=ranks[owner], group=self.layer.group, async_op=True)
                self.broadcasts.append(label(handle, f"shadow expert {e}", self.layer.name))
            self.copies[e] = flat

    def _weights(self, flats):
        """(w1, b1, w2, b2) dicts keyed by expert id: views of the flat copies."""
        views = {name: {} for name, _ in self.named}
        for e, flat in zip(self.shadowed, flats):
            parts = flat.split([p[0].numel() for _, p in self.named])
            for (name, p), part in zip(self.named, parts):
                views[name][e] = part.view(p.shape[1:])
        return tuple(views[name] for name, _ in self.named)

    def home_forward(self, x):
        """The shadowed experts on this rank's own rows for them, once their weights have arrived."""
        for handle in self.broadcasts:
            handle.wait()
        self.broadcasts = []
        grad = torch.enable_grad() if self.differentiable else contextlib.nullcontext()
        with (
            grad,
            span(f"moe/{self.layer.name}/shadowed experts", rows=int(self.home_index.numel()), experts=self.shadowed),
        ):
            rows = x[self.home_index].detach().requires_grad_(self.differentiable)
            flats = [self.copies.pop(e).requires_grad_(self.differentiable) for e in self.shadowed]
            y = run_experts(
                rows, self.home_counts, self._weights(flats), self.shadowed, getattr(self.layer, "expert_function", ffn)
            )
        if self.differentiable:
            self.saved = (rows, flats, y)
        self.result = y.detach()

    def home_backward(self, grad):
        """Their vector-Jacobian product; the copies' gradients start back to the owners at once."""
        rows, flats, y = self.saved
        self.saved = None
        with span(f"moe/{self.layer.name}/shadowed experts", rows=int(rows.shape[0]), backward=True):
            grads = torch.autograd.grad(y, [rows, *flats], grad[self.home_index], allow_unused=True)
        self.result = grads[0] if grads[0] is not None else torch.zeros_like(rows)
        total = torch.cat([g if g is not None else torch.zeros_like(f) for g, f in zip(grads[1:], flats)])
        total = predivide(total, [p for _, p in self.named])  # fp16 under a data-parallel average: experts.py
        handle = None
        if self.distributed:
            handle = label(
                comm.all_reduce(total, op="sum", group=self.layer.group, async_op=True),
                "shadow experts backward",
                self.layer.name,
            )
        self.reduction = (total, handle)

    def finish(self, param_grads: list) -> list:
        """The owners add the summed gradients of their shadowed experts to the local experts' ones.
        ``param_grads`` follow the trainable expert parameters, in order (``units.overlapped``)."""
        total, handle = self.reduction
        self.reduction = None
        if handle is not None:
            handle.wait()
        trainable = [p for _, p in self.named if p.requires_grad]
        parts = iter(total.split([p[0].numel() for _, p in self.named] * len(self.shadowed)))
        for e in self.shadowed:
            owner, i = self._owner(e)
            for _, p in self.named:
                part = next(parts)
                if owner != self.layer.rank or not p.requires_grad:
                    continue
                j = next(j for j, q in enumerate(trainable) if q is p)
                g = torch.zeros_like(p)
                g[i] = part.view(p.shape[1:])
                param_grads[j] = g if param_grads[j] is None else param_grads[j] + g
        return param_grads
