"""What every sharded strategy shares: a rank's slice of the training state, the model the user holds, the engine.

Under ZeRO (and FSDP) no rank runs the optimizer on the whole model. Parameters are laid out in flat buffers (see
`flat.py`); rank r owns slice r of every buffer and updates only that slice:

    reduced gradient slice  ->  fp32 master slice  --optimizer-->  updated master  ->  model's slice

This file holds the parts that do not depend on the stage (the optimizer that runs that loop, and the allow-list
of optimizers it may wrap: `sharded_optimizer.py`; clipping slices by the global norm: `sharded_clipping.py`):

- `Shard`: one rank's slice of one flat buffer, as the optimizer sees it.
- `ShardedModel`: the wrapper the user holds (forward as the original's, plus `full_state_dict`, `memory_groups`,
  `clip_grad_norm_`, `no_sync`).
- `ShardedEngine`: the base of a stage's machinery (who am I in the group, flattening with fp32 masters, the
  end-of-backward callback, gathering the full fp32 parameters).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_map

from .. import comm
from ..runtime import env
from .flat import FlatBuffer
from .grad_in_slices import clear_before_accumulating, is_placeholder, put_placeholders
from .loading import into_slices, watch_loading
from .local import compute_dtype as local_compute_dtype
from .local import forward_backward as forward_then_backward
from .refusals import kept_as, refuse_cast_since_wrap, refuse_casting, refuse_frozen_since_wrap
from .scaler import scaler_for
from .sharded_clipping import clip_grad_norm_
from .sharded_optimizer import ShardedOptimizer


def compute_dtype(mixed_precision) -> torch.dtype:
    """The dtype the model computes in: float32, or the 16-bit dtype mixed precision asks for
    (the option means the same as for "local" and "ddp": see `local.compute_dtype`)."""
    return local_compute_dtype(mixed_precision) or torch.float32


class Shard:
    """One rank's slice of one flat buffer, as the optimizer sees it.

    master: the fp32 Parameter the optimizer updates. In fp32 training it is the model's own slice
            (no copy); with mixed precision it is a separate fp32 copy (the "master weights").
    grad:   the reduced (averaged over ranks) gradient slice in the compute dtype, or None.
    """

    def __init__(self, master: nn.Parameter, grad: torch.Tensor | None = None):
        self.master, self.grad = master, grad


# --- the model the user holds ------------------------------------------------------------------------
class ShardedModel(nn.Module):
    """The wrapped model: forward as the original's, plus what a sharded model must provide.

    full_state_dict()     {original name: full fp32 tensor} on every rank (gathers the fp32 slices)
    memory_groups()       {"params", "grads", "optimizer"}: the tensors that exist on this rank now
    clip_grad_norm_(max)  clip by the global norm of the averaged gradient (every rank's slices)
    no_sync()             ZeRO-1: accumulate without communicating; ZeRO-2/3: accepted, no effect
    zero_grad()           the optimizer's: clears the slices (nn.Module's would clear only each p.grad)
    flat_buffers()        the FlatBuffers being sharded (to look at the layout and its padding)
    """

    def __init__(self, module: nn.Module, engine: ShardedEngine):
        super().__init__()
        self.module = module
        self.engine = engine  # not an nn.Module: stays out of named_parameters()
        watch_loading(module, engine.name, engine.where_loaded)
        for m in module.modules():
            m.register_state_dict_post_hook(functools.partial(_refuse_sharded_parameters, engine))
        self.kept_as = kept_as(module, gathered=engine.dtype)

    def _apply(self, fn, recurse=True):
        refuse_casting(self, fn)
        return super()._apply(fn, recurse)

    def forward(self, *args, **kwargs):
        refuse_cast_since_wrap(self.kept_as)
        args, kwargs = tree_map(self._prepare, args), tree_map(self._prepare, kwargs)
        output = self.engine.forward(self.module, args, kwargs)
        return output if self.scaler is None else self.scaler.scale_outputs(output)

    @property
    def scaler(self):
        """fp16: the dynamic loss scaler (`scaler.py`); None otherwise."""
        return self.engine.scaler

    def _prepare(self, value):
        """Inputs go to this rank's device; floating ones to the compute dtype (token ids stay integers)."""
        if not torch.is_tensor(value):
            return value
        dtype = self.engine.dtype if value.is_floating_point() else value.dtype
        return value.to(device=env.device(), dtype=dtype)

    def forward_backward(self, *inputs, **kwargs) -> torch.Tensor:
        """One batch's forward and backward; the loss, detached (`local.forward_backward`)."""
        return forward_then_backward(self, *inputs, **kwargs)

    def full_state_dict(self) -> dict:
        return self.engine.full_state_dict()

    def memory_groups(self) -> dict:
        return self.engine.memory_groups()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        clip = lambda limit: clip_grad_norm_(self.engine.shards(), limit, norm_type, self.engine.group)  # noqa: E731
        return clip(max_norm) if self.scaler is None else self.scaler.clip_norm(clip, max_norm)

    def no_sync(self):
        return self.engine.no_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The optimizer's `zero_grad()`: the gradients are the strategy's (its slices, ZeRO-1's flat buffer), and
        nn.Module's, clearing only each `p.grad`, would leave them to add into the next step's."""
        self.engine.zero_grad(set_to_none)

    def flat_buffers(self) -> list[FlatBuffer]:
        return [piece.flat for piece in self.engine.pieces]


def _refuse_sharded_parameters(engine, module, state_dict, prefix, local_metadata) -> None:
    """`state_dict()` never hands out this rank's piece of a parameter under the parameter's name: between uses
    ZeRO-3's and FSDP's parameters are the pieces this rank keeps (`flat.ParamViews`), and a checkpoint of them
    would load into nothing."""
    for name, p in module._parameters.items():
        if p is not None and engine.sharded_now(p):
            raise RuntimeError(
                f"state_dict(): {prefix + name!r} is only this rank's piece of it between steps ({p.numel()} "
                f"elements): this strategy keeps a slice of every parameter. For the full parameters call "
                f"toolkit.parallel.full_state_dict(model) on every rank (it gathers them); to save, "
                f"toolkit.parallel.checkpoint.save_full(model, optimizer, path) or save_sharded."
            )


class ShardedEngine:
    """The base of a stage's machinery. A subclass fills `pieces`: objects with `.params` (the
    parameters of one flat buffer, in layout order), `.flat` (the FlatBuffer in the compute dtype)
    and `.mine` (this rank's `Shard`), and implements the backward and step parts.
    """

    name = "sharded"

    def __init__(self, module: nn.Module, dtype: torch.dtype, group=None):
        self.module, self.dtype, self.group = module, dtype, group
        ranks = comm.group_ranks(group)
        self.world, self.rank = len(ranks), ranks.index(dist.get_rank())
        self.names = {p: n for n, p in module.named_parameters()}  # a tied Parameter: its first name
        self.params = [p for p in self.names if p.requires_grad]  # sharded and trained
        self.frozen = [p for p in self.names if not p.requires_grad]  # replicated, cast, left alone
        for p in self.frozen:
            p.data = p.data.to(dtype)
        self.pieces: list = []
        self.unit_of: dict = {}  # ZeRO-3 and FSDP: each parameter's unit (its `views` say where it points)
        self.optimizer: ShardedOptimizer | None = None
        self.scaler = scaler_for(dtype)  # fp16: a rank sees only its slice, so overflow is agreed on
        if self.scaler is not None:
            self.scaler.group, self.scaler.across_ranks = group, True
        self._callback_queued = False

    def shards(self) -> list[Shard]:
        return [piece.mine for piece in self.pieces]

    def shapes(self) -> dict:
        """{name: shape} of every parameter as the model computes with it (between uses ZeRO-3's and FSDP's
        parameters are only this rank's pieces: the layout keeps their shapes)."""
        found = {self.names[p]: s for piece in self.pieces for p, s in zip(piece.params, piece.flat.shapes)}
        return {n: found.get(n, p.shape) for p, n in self.names.items()}

    def where_loaded(self, p: nn.Parameter):
        """Where `load_state_dict()` must put a value of `p` for it to train (`loading.py`): the parameter itself (None:
        fp32 ZeRO-1/2, whose masters are slices of the parameters, and frozen ones), or this rank's slice of the fp32
        master (and of ZeRO-3's 16-bit kept slice), instead of the parameter where it is only this rank's piece."""
        found = {q: (piece, i) for piece in self.pieces for i, q in enumerate(piece.params)}.get(p)
        pieces = self.sharded_now(p)
        if found is None or (self.dtype == torch.float32 and not pieces):
            return None
        piece, index = found
        kept = getattr(piece, "kept", piece.mine.master)  # ZeRO-3's 16-bit slice beside the master (fp32: the master)
        slices = [piece.mine.master] if kept is piece.mine.master else [piece.mine.master, kept]
        return into_slices(slices, piece.flat, index, self.rank, torch_copies=not pieces)

    def sharded_now(self, p: nn.Parameter) -> bool:
        """Whether `p` is, right now, only this rank's piece of it (ZeRO-3 and FSDP between uses)."""
        unit = self.unit_of.get(p)
        return unit is not None and not unit.views.is_full

    def step_groups(self) -> list[list[Shard]]:  # what the optimizer steps together, group after group
        return [self.shards()]

    def flatten(self, params: list) -> tuple[FlatBuffer, nn.Parameter]:
        """Lay `params` out flat in the compute dtype; make the fp32 master of this rank's slice.

        fp32 training: the master *is* the slice (a view: the optimizer updates the model in place,
        no extra bytes). Mixed precision: the master is a separate fp32 copy, taken from the fp32
        values before they are rounded to 16 bits.
        """
        fp32 = FlatBuffer.of(params, self.world, dtype=torch.float32)
        if self.dtype == torch.float32:
            return fp32, nn.Parameter(fp32.shard(self.rank))
        master = nn.Parameter(fp32.shard(self.rank).clone())
        return FlatBuffer(fp32.shapes, self.world, data=fp32.data.to(self.dtype)), master

    # --- hooks into the training loop ------------------------------------------------------------
    def forward(self, module, args, kwargs):
        return module(*args, **kwargs)

    def queue_end_of_backward(self) -> None:
        """From a hook inside backward: have `end_of_backward()` run once autograd has finished."""
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        self._callback_queued = False
        refuse_frozen_since_wrap(self.module, self.params)
        self.end_of_backward()
        put_placeholders(self.params, self.name)  # p.grad is not the gradient now (`grad_in_slices.py`)

    def watch_gradients(self, ready) -> None:
        """`ready(p)` once autograd has finished each trained parameter's gradient; before it accumulates one,
        the last backward's placeholder is dropped."""
        for p in self.params:
            p.register_post_accumulate_grad_hook(ready)
        clear_before_accumulating(self.params)

    def end_of_backward(self) -> None:
        pass

    def before_step(self) -> None:
        pass

    def after_step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        for s in self.shards():
            if set_to_none or s.grad is None:
                s.grad = None
            else:
                s.grad.zero_()
        for p in self.params:
            if is_placeholder(p.grad):
                p.grad = None

    def no_sync(self):
        """Accepted so that one training loop serves every strategy, and changes nothing: a stage that
        keeps only a slice of the gradients cannot postpone their reduction (that would need the full
        gradients it does not keep), so every backward still reduce-scatters and adds into the slice."""
        return contextlib.nullcontext()

    # --- views for people ----------------------------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """Every rank's fp32 slices all-gathered into full tensors, under the original names."""
        out = {self.names[p]: p.detach().float().clone() for p in self.frozen}
        for piece in self.pieces:
            full = FlatBuffer(piece.flat.shapes, self.world, dtype=torch.float32, device=piece.mine.master.device)
            comm.all_gather(full.data, piece.mine.master.detach(), group=self.group)
            out.update({self.names[p]: view.clone() for p, view in zip(piece.params, full.views())})
        return {n: out[n] for n in self.names.values()}

    def optimizer_tensors(self) -> list[torch.Tensor]:
        """Optimizer bytes: the inner optimizer's states, plus the fp32 masters when they are copies."""
        tensors = self.optimizer.state_tensors() if self.optimizer is not None else []
        if self.dtype != torch.float32:
            tensors += [t for s in self.shards() for t in (s.master, s.master.grad) if t is not None]
        return tensors
