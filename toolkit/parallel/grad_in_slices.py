"""What `p.grad` is on a sharded model after its backward: a placeholder that refuses use and says why.

After ZeRO's or FSDP's backward the averaged gradient lives in the ranks' slices (`Shard.grad`). Under ZeRO-2, ZeRO-3
and FSDP no rank holds a parameter's whole gradient; under ZeRO-1 each `p.grad` holds this rank's slice of the
average beside its own local gradient for the rest. Code written for one process reads `p.grad` anyway, and reads
it wrong without a word. torch's `clip_grad_norm_(model.parameters(), ...)` clipped nothing and returned 0
(ZeRO-2/3, FSDP), or a norm that differed from rank to rank (ZeRO-1); an optimizer built on `model.parameters()`
stepped nothing, or stepped each rank its own way. So after the backward that reduces, every trained parameter's
`.grad` is a `GradInSlices`: the parameter's shape, dtype and device, no storage, and any operation on it raises,
naming the calls that work (the optimizer `wrap()` returned, `model.clip_grad_norm_`). FSDP2 answers the same
question the other way: its gradients are `DTensor`s, whose norm is a collective.

The placeholder goes away on its own: a hook on each parameter drops it just before autograd accumulates the next
backward's gradient, and `zero_grad()` drops it (ZeRO-1's gradients are views of its flat buffer again then).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten


class GradInSlices(torch.Tensor):
    """Stands where `p.grad` would be: the metadata of the parameter, and a refusal for anything else."""

    @staticmethod
    def __new__(cls, param: torch.Tensor, strategy: str):
        grad = torch.Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype, device=param.device)
        grad.strategy = strategy
        return grad

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        placeholder = next(a for a in tree_flatten((args, kwargs))[0] if isinstance(a, cls))
        raise RuntimeError(_refusal(placeholder.strategy, f"{func.__name__} read p.grad"))

    def __repr__(self) -> str:
        return f"GradInSlices(shape={tuple(self.shape)}: {self.strategy} keeps this gradient in the ranks' slices)"


def _refusal(strategy: str, what: str) -> str:
    return (
        f"{strategy}: {what}, which after backward is not this parameter's gradient: {strategy} keeps the averaged "
        f"gradient in the ranks' slices of its flat buffers, and code written for one process would see nothing "
        f"there, or only this rank's mix. Step with the optimizer wrap() returned (not one built on "
        f"model.parameters()); to clip, or to log the gradient norm, call model.clip_grad_norm_(max_norm) on every "
        f"rank (it adds every rank's slices); this rank's slices are [s.grad for s in model.engine.shards()]. The "
        f"next backward or zero_grad() clears p.grad."
    )


def is_placeholder(grad) -> bool:
    return isinstance(grad, GradInSlices)


def real_grads(params) -> list[torch.Tensor]:
    """The gradients `params` hold as tensors (for memory accounting): placeholders have no bytes."""
    return [p.grad for p in params if p.grad is not None and not is_placeholder(p.grad)]


def put_placeholders(params, strategy: str) -> None:
    """After the backward that reduced: every trained parameter's `.grad` refuses use."""
    for p in params:
        p.grad = GradInSlices(p, strategy)


def clear_before_accumulating(params) -> None:
    """A hook on each parameter: autograd accumulates its next gradient into nothing, not into the placeholder."""
    for p in params:
        p.register_hook(lambda grad, p=p: _drop(p))


def _drop(p) -> None:
    if is_placeholder(p.grad):
        p.grad = None
