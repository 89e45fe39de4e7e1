"""What every sharded strategy shares: a rank's slice of the training state, and the optimizer that steps it.

Under ZeRO (and FSDP) no rank runs the optimizer on the whole model. Parameters are laid out in flat buffers (see
`flat.py`); rank r owns slice r of every buffer and updates only that slice:

    reduced gradient slice  ->  fp32 master slice  --optimizer-->  updated master  ->  model's slice

This file holds the parts that do not depend on the stage (clipping slices by the global norm: `sharded_clipping.py`):

- `ShardedOptimizer`: that loop around an ordinary torch optimizer on the rank's fp32 slices, what `wrap` returns
  as the optimizer: a real `torch.optim.Optimizer` (learning-rate schedulers see its `param_groups`).
- `ShardedModel`: the wrapper the user holds (forward as the original's, plus `full_state_dict`, `memory_groups`,
  `clip_grad_norm_`, `no_sync`).
- `ShardedEngine`: the base of a stage's machinery (who am I in the group, flattening with fp32 masters, the
  end-of-backward callback, gathering the full fp32 parameters); the elementwise allow-list.

Why only some optimizers: a slice boundary may cut a weight matrix anywhere, and a padded slice holds a few fake
zeros. That is harmless exactly when the update of every element depends only on that element's own gradient and
state (SGD, Adam, AdamW, ...): each rank then computes precisely what one process would have computed for those
elements. An optimizer that looks at a whole tensor at once (LAMB's and LARS's per-layer trust ratio, Adafactor's
row and column statistics, L-BFGS's line search over all parameters, Shampoo's preconditioners) would see a
meaningless piece of a tensor. So the list below is an explicit allow-list, not a guess.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_map

from .. import comm
from ..runtime import env
from .flat import FlatBuffer
from .local import compute_dtype as local_compute_dtype
from .local import forward_backward as forward_then_backward
from .scaler import scaler_for
from .sharded_clipping import clip_grad_norm_, global_grad_norm  # noqa: F401 - re-exported

# Optimizers whose update is elementwise: one element's new value depends on its own gradient and
# state, plus scalars (learning rate, step count). Adding one here is a claim about its math.
ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
)


def check_optimizer(strategy: str, optimizer_factory) -> None:
    """Raise ValueError unless `optimizer_factory` builds an optimizer from the allow-list.

    The factory is tried on a one-element dummy parameter, so nothing is communicated or allocated
    before a bad choice is reported.
    """
    try:
        probe = optimizer_factory([nn.Parameter(torch.zeros(1))])
    except Exception as exc:  # noqa: BLE001 - report any failure to build as a bad factory
        raise ValueError(
            f"strategy {strategy!r} could not build the optimizer from {optimizer_factory!r} "
            f"on a list of parameters ({type(exc).__name__}: {exc})."
        ) from exc
    if type(probe) not in ELEMENTWISE_OPTIMIZERS:
        names = ", ".join(o.__name__ for o in ELEMENTWISE_OPTIMIZERS)
        raise ValueError(
            f"strategy {strategy!r} cannot shard {type(probe).__name__}: each rank updates only its slice of "
            f"the flattened parameters, which is exact only for optimizers whose update is elementwise. "
            f"Sharded optimizers allowed: {names}. Use one of them, or an unsharded strategy ('ddp') "
            f"for {type(probe).__name__}."
        )


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


# --- the optimizer the user holds --------------------------------------------------------------------
class ShardedOptimizer(torch.optim.Optimizer):
    """Steps this rank's slices; the strategy (`engine`) brings the results back into the model.

    step():  0. fp16: if any rank's reduced slices hold an inf or NaN, skip 1-4 (`scaler.py`)
             1-3, per sub-group of shards (`engine.step_groups()`: all at once, or ZeRO-3's): give each fp32
             master its gradient (the slice, cast to fp32 if 16-bit, unscaled), run the user's optimizer on
             those masters, drop those fp32 gradients (a transient copy, not model state)
             4. engine.after_step(): 16-bit copies of the masters; the all-gather of ZeRO-1/2
    zero_grad(): the engine clears its gradients. `param_groups` and `state` are the inner optimizer's own,
    so LR schedulers and `state_dict()` act on what is really stepped.
    """

    def __init__(self, inner: torch.optim.Optimizer, engine: ShardedEngine):
        super().__init__(inner.param_groups, inner.defaults)
        self.inner, self.engine = inner, engine
        self.param_groups, self.state = inner.param_groups, inner.state

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("sharded optimizers take no closure: call loss.backward() before step().")
        self.engine.before_step()
        scaler = self.engine.scaler
        found_inf = scaler is not None and scaler.found_inf([s.grad for s in self.engine.shards()])
        if not found_inf:  # every rank agreed (an all-reduce of the flag), so all step or all skip
            groups = [g["params"] for g in self.inner.param_groups]
            where = {id(p): i for i, members in enumerate(groups) for p in members}
            try:  # (the optimizer sees one sub-group's masters at a time: its groups are put back)
                for shards in self.engine.step_groups():
                    self._step(shards, scaler, where)
            finally:
                for group, members in zip(self.inner.param_groups, groups):
                    group["params"] = members
        if scaler is not None:
            scaler.update(found_inf)
        if not found_inf:
            self.engine.after_step()

    def _step(self, shards: list, scaler, where: dict) -> None:
        """Steps 1-3 for one sub-group of shards: its fp32 gradients exist only while it steps."""
        for s in shards:
            s.master.grad = None if s.grad is None else s.grad.to(torch.float32)  # fp32: no copy
        if scaler is not None:
            scaler.unscale_([s.master.grad for s in shards])
        if len(shards) < len(where):  # it sees only this sub-group's masters (DeepSpeed's ZeRO-3 does so):
            for i, group in enumerate(self.inner.param_groups):
                group["params"] = [s.master for s in shards if where[id(s.master)] == i]
        self.inner.step()
        for s in shards:
            s.master.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad(set_to_none)

    def memory_groups(self) -> dict:
        return self.engine.memory_groups()

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor the inner optimizer keeps (Adam's two moments and its step counters, ...)."""
        return [v for state in self.inner.state.values() for v in state.values() if torch.is_tensor(v)]


# --- the model the user holds ------------------------------------------------------------------------
class ShardedModel(nn.Module):
    """The wrapped model: forward as the original's, plus what a sharded model must provide.

    full_state_dict()     {original name: full fp32 tensor} on every rank (gathers the fp32 slices)
    memory_groups()       {"params", "grads", "optimizer"}: the tensors that exist on this rank now
    clip_grad_norm_(max)  clip by the global norm of the averaged gradient (every rank's slices)
    no_sync()             ZeRO-1: accumulate without communicating; ZeRO-2/3: accepted, no effect
    flat_buffers()        the FlatBuffers being sharded (to look at the layout and its padding)
    """

    def __init__(self, module: nn.Module, engine: ShardedEngine):
        super().__init__()
        self.module = module
        self.engine = engine  # not an nn.Module: stays out of named_parameters()

    def forward(self, *args, **kwargs):
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

    def flat_buffers(self) -> list[FlatBuffer]:
        return [piece.flat for piece in self.engine.pieces]


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
        self.optimizer: ShardedOptimizer | None = None
        self.scaler = scaler_for(dtype)  # fp16: a rank sees only its slice, so overflow is agreed on
        if self.scaler is not None:
            self.scaler.group, self.scaler.across_ranks = group, True
        self._callback_queued = False

    def shards(self) -> list[Shard]:
        return [piece.mine for piece in self.pieces]

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
        self.end_of_backward()

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
