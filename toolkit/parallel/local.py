"""One process, the whole batch: the reference ("oracle") that every strategy is checked against.

It also holds the two things every strategy shares, because they are the same on one process as on many:

1. `Wrapped`, the thin wrapper a strategy returns: `forward` passes through, and it adds
   `full_state_dict()`, `memory_groups()` and `clip_grad_norm_()`. Strategies subclass it.
2. The mixed-precision recipe (`mixed_precision=True` or a 16-bit dtype; True means bfloat16):

   - the model's parameters, and so its activations and gradients, are 16-bit:  2 + 2 bytes per parameter;
   - the optimizer never sees them: it is built on fp32 *master* copies, so master weights and
     Adam's two moments are fp32:                                               K = 4 + 4 + 4 = 12 bytes;
   - a step: 16-bit gradients become the masters' fp32 `.grad` (and leave the model), the optimizer
     updates the masters, the masters are rounded back into the 16-bit parameters.

   Why masters: an update lr * m / sqrt(v) is often smaller than bfloat16's spacing (8 significant bits),
   so adding it to a 16-bit weight would round it away; summed in fp32 it is kept.
   Two optimizer hooks do the copies, so `optimizer` stays a real torch optimizer (LR schedulers,
   state_dict and param_groups all work). float16 adds dynamic loss scaling (`scaler.py`): its
   gradients would underflow without it; bfloat16 needs none.

So "local" with `mixed_precision` is the oracle for mixed-precision strategies too.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from . import check_options
from .loading import Place, watch_loading
from .refusals import kept_as, refuse_cast_since_wrap, refuse_casting
from .scaler import scaler_for

OPTIONS = ("mixed_precision",)


_NAMED = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "torch.bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "torch.float16": torch.float16,
}


def compute_dtype(mixed_precision) -> torch.dtype | None:
    """The 16-bit compute dtype asked for, or None for plain fp32 training.

    Names ("bf16", "torch.bfloat16", ...) are accepted too, so a config read back from a saved Run works.
    """
    if mixed_precision is None or mixed_precision is False:
        return None
    if mixed_precision is True:
        return torch.bfloat16
    if mixed_precision in (torch.bfloat16, torch.float16):
        return mixed_precision
    if isinstance(mixed_precision, str) and mixed_precision in _NAMED:
        return _NAMED[mixed_precision]
    policy = isinstance(mixed_precision, dict) or hasattr(mixed_precision, "reduce_dtype")
    raise ValueError(
        f"mixed_precision={mixed_precision!r}: use False, True (bfloat16), "
        "torch.bfloat16 or torch.float16 (or their names, e.g. 'bf16')."
        + (
            " A MixedPrecision(param_dtype, reduce_dtype), or its dict, is for fsdp, zero1 and zero2, which reduce "
            "gradients in buffers of their own."
            if policy
            else ""
        )
    )


class MasterWeights:
    """fp32 master copies of some parameters; the optimizer steps the masters, not the parameters.

    Make it while the parameters are still fp32 (then cast the model). `attach(optimizer)` adds
    the two copies around every `optimizer.step()`. ZeRO can use the same class on its flat shards.
    """

    def __init__(self, params, scaler=None):
        self.params = list(params)
        self.masters = [nn.Parameter(p.detach().float().clone(), requires_grad=p.requires_grad) for p in self.params]
        self.scaler = scaler  # fp16: a LossScaler (scaler.py)

    def grads_to_masters(self, *_):
        """Before the step: each 16-bit gradient moves into its master's fp32 `.grad`. fp16: unscaled
        there, and on an overflow every master's gradient is dropped, so the optimizer skips the step."""
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None  # the step consumes the gradient, so `zero_grad()` on the optimizer is enough
        if self.scaler is not None:
            found_inf = self.scaler.unscale_and_check([m.grad for m in self.masters])
            if found_inf:
                for m in self.masters:
                    m.grad = None  # torch optimizers leave a parameter without a gradient alone
            self.scaler.update(found_inf)

    @torch.no_grad()
    def masters_to_params(self, *_):
        """After the step: round the updated masters into the 16-bit parameters; drop the fp32 grads."""
        for p, m in zip(self.params, self.masters):
            p.copy_(m)
            m.grad = None

    def attach(self, optimizer):
        optimizer.register_step_pre_hook(self.grads_to_masters)
        optimizer.register_step_post_hook(self.masters_to_params)
        return optimizer


def clip_grad_norm_(grads, max_norm: float, own=(), reduce=None) -> torch.Tensor:
    """Scale gradients in place so that their joint L2 norm is at most `max_norm`; return the norm before.

    grads: gradients every rank holds alike (replicated). own: gradients only this rank holds (its
    experts): their sum of squares is completed over the ranks by `reduce(tensor)` before the root.
    Sums of squares are taken in fp32 whatever the gradients' dtype.
    """
    grads, own = [g for g in grads if g is not None], [g for g in own if g is not None]
    device = (grads or own)[0].device if grads or own else None
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        total += g.float().pow(2).sum()
    if own or reduce is not None:
        part = torch.zeros((), dtype=torch.float32, device=device)
        for g in own:
            part += g.float().pow(2).sum()
        if reduce is not None:
            reduce(part)
        total += part
    norm = total.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # as torch.nn.utils.clip_grad_norm_
    for g in grads + own:
        g.mul_(coef.to(g.dtype))
    return norm


class Wrapped(nn.Module):
    """The wrapper every strategy returns: the original model inside, plus what training tools ask of it."""

    def __init__(self, module: nn.Module, mixed_precision=False):
        super().__init__()
        self.module = module
        self.dtype = compute_dtype(mixed_precision)
        self.master = None
        self.scaler = scaler_for(self.dtype)  # fp16 only: dynamic loss scaling
        if self.dtype is not None:
            self.master = MasterWeights(module.parameters(), self.scaler)  # fp32 copies first, then cast
            module.to(self.dtype)
        master_of = dict(zip(self.master.params, self.master.masters)) if self.master is not None else {}
        watch_loading(module, "this strategy", lambda p: Place(master_of[p].copy_) if p in master_of else None)
        self.optimizer = None
        self.kept_as = kept_as(module)

    def _apply(self, fn, recurse=True):
        refuse_casting(self, fn)
        return super()._apply(fn, recurse)

    def build_optimizer(self, optimizer) -> torch.optim.Optimizer:
        """`optimizer(params)` on the fp32 masters (mixed precision) or on the model's parameters."""
        params = self.master.masters if self.master is not None else list(self.module.parameters())
        self.optimizer = optimizer(params)
        if self.master is not None:
            self.master.attach(self.optimizer)
        return self.optimizer

    def forward(self, *args, **kwargs):
        refuse_cast_since_wrap(self.kept_as)
        output = self.module(*self._prepare(args), **self._prepare(kwargs))
        return output if self.scaler is None else self.scaler.scale_outputs(output)

    def forward_backward(self, *inputs, **kwargs) -> torch.Tensor:
        """One batch's forward and backward; returns the loss, detached (`forward_backward` below)."""
        return forward_backward(self, *inputs, **kwargs)

    def _prepare(self, value):
        """Inputs go to the parameters' device; floating inputs to the compute dtype (ids stay ints)."""
        if isinstance(value, torch.Tensor):
            p = next(self.module.parameters(), None)
            if p is None:
                return value
            dtype = p.dtype if value.is_floating_point() else value.dtype
            return value.to(device=p.device, dtype=dtype)
        if isinstance(value, (list, tuple)):
            return type(value)(self._prepare(v) for v in value)
        if isinstance(value, dict):
            return {k: self._prepare(v) for k, v in value.items()}
        return value

    def full_state_dict(self) -> dict:
        """{original parameter name: full fp32 tensor}: the masters under mixed precision."""
        if self.master is not None:
            return {
                name: m.detach().clone() for (name, _), m in zip(self.module.named_parameters(), self.master.masters)
            }
        return {name: p.detach().clone() for name, p in self.module.named_parameters()}

    def memory_groups(self) -> dict:
        """The tensors on this rank now: params, grads, optimizer (fp32 masters and states count there)."""
        params = list(self.module.parameters())
        optimizer = []
        if self.master is not None:
            optimizer += self.master.masters + [m.grad for m in self.master.masters if m.grad is not None]
        if self.optimizer is not None:
            optimizer += [
                t for state in self.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)
            ]
        return {"params": params, "grads": [p.grad for p in params if p.grad is not None], "optimizer": optimizer}

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients to `max_norm` in place; return the global norm (fp32).

        Expert parameters (toolkit.moe) differ per rank: their part of the norm is summed over the
        experts' group, so every rank computes the same norm and dense parameters stay identical.
        """
        from ..moe.experts import Experts

        params = [p for p in self.module.parameters()]
        own = [p.grad for p in params if getattr(p, "_toolkit_expert", False)]
        replicated = [p.grad for p in params if not getattr(p, "_toolkit_expert", False)]
        groups = [m.group for m in self.module.modules() if isinstance(m, Experts)]
        reduce = None
        if groups and torch.distributed.is_initialized():
            from .. import comm

            reduce = lambda t: comm.all_reduce(t, group=groups[0])  # noqa: E731
        if self.scaler is not None:  # the gradients still carry the loss scale
            return self.scaler.clip_norm(lambda limit: clip_grad_norm_(replicated, limit, own, reduce), max_norm)
        return clip_grad_norm_(replicated, max_norm, own, reduce)


def forward_backward(model: nn.Module, *inputs, **kwargs) -> torch.Tensor:
    """One batch's forward and backward on a wrapped model; the loss, detached.

    For a data-parallel strategy this is `loss = model(x, y); loss.backward()`. Under pipeline parallelism
    (`pp` > 1) the wrapped model splits the batch into micro-batches and runs the whole schedule instead
    (`toolkit.parallel.pipeline`), so `train.py` and the simulator can call `model.forward_backward(x, y)`
    whatever the strategy."""
    from ..trace.events import phase

    with phase("forward"):
        loss = model(*inputs, **kwargs)
    with phase("backward"):
        loss.backward()
    return loss.detach()


def wrap(model: nn.Module, optimizer, **options):
    """The reference: `Wrapped(model)` and `optimizer(...)`, with an optional mixed-precision policy."""
    check_options("local", options, OPTIONS)
    wrapped = Wrapped(model, options.get("mixed_precision", False))
    return wrapped, wrapped.build_optimizer(optimizer)
