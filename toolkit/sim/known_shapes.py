"""Known shapes: a simulated step's meta operations answered from the ones it already ran.

On the meta device an operation computes nothing but its outputs' shapes, strides and dtypes, and torch
computes many of those in Python (its decompositions and references: a layer norm's backward takes about
3 ms on meta, more than the same op on a small real tensor). A step repeats the same few operations on the
same shapes, layer after layer, micro-batch after micro-batch, step after step, so `KnownShapes` runs each
(operation, input shapes) once and afterwards makes fresh meta tensors of the outputs it saw.

Only where that is exactly what the operation would do: an aten operation that mutates nothing and returns
new tensors (no alias in its schema, none seen), every tensor argument a plain meta tensor, and outputs
whose storage is what `empty_strided` makes. Anything else runs as always. It sits below the memory tracker,
which therefore still sees every output allocated, and below the operation counter, which still sees every
operation.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ENABLED = True  # False: every meta operation computed by torch (the bench and the tests compare the two)

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_MISSING = object()
_UNSAFE = {torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output, torch.Tag.inplace_view}


def _pure(func) -> bool:
    """An aten operation that mutates no argument and returns no alias of one (its schema says so)."""
    schema = func._schema
    return func.namespace == "aten" and not schema.is_mutable and all(r.alias_info is None for r in schema.returns)


def shape_key(func, args, kwargs) -> tuple | None:
    """What an operation's outputs' shapes can depend on: the operation, its meta tensors' shapes, strides and
    dtypes and its other arguments; None where that is not all of it (a real tensor, a generator, a subclass,
    an operation whose output shape depends on values). The default dtype too: a factory or a Python scalar's
    promotion reads it."""
    key = [func, torch.get_default_dtype()]
    if not ENABLED or _UNSAFE.intersection(func.tags) or not _key_of(args, key) or not _key_of(kwargs, key):
        return None
    return tuple(key)


def _key_of(value, into: list) -> bool:
    """Append what the outputs' shapes can depend on; False where memoizing is not safe."""
    if isinstance(value, torch.Tensor):
        if type(value) not in _PLAIN or not value.is_meta or value.layout is not torch.strided:
            return False  # a real tensor, a subclass, a sparse one (no strides): run it
        into.append((tuple(value.shape), value.stride(), value.dtype))
        return True
    if isinstance(value, (tuple, list)):
        into.append(len(value))
        return all(_key_of(v, into) for v in value)
    if isinstance(value, dict):
        into.append(tuple(value))
        return all(_key_of(v, into) for v in value.values())
    if isinstance(
        value, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
    ):
        into.append((type(value), value))
        return True
    return False  # a generator, a subclass, anything unforeseen: run it


def _fresh(t: torch.Tensor):
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _spec(out, inputs: set):
    """How to make `out` again, or None when a fresh tensor would not be the same thing."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    seen = set(inputs)
    for o in outs:
        if o is None:
            continue
        if (
            type(o) is not torch.Tensor
            or not o.is_meta
            or o.layout is not torch.strided
            or o.storage_offset() != 0
            or o.untyped_storage()._cdata in seen
            or o.untyped_storage().nbytes() != _fresh(o).untyped_storage().nbytes()
        ):
            return None
        seen.add(o.untyped_storage()._cdata)
    specs = tuple(None if o is None else (tuple(o.shape), o.stride(), o.dtype) for o in outs)
    return (type(out) if isinstance(out, (tuple, list)) else None, specs)


def _build(spec):
    kind, specs = spec
    made = [None if s is None else torch.empty_strided(s[0], s[1], dtype=s[2], device="meta") for s in specs]
    return made[0] if kind is None else kind(made)


class Memo(dict):
    """A process-wide memo (simulations in a sweep share their shapes), emptied when it grows past `limit`."""

    def __init__(self, limit: int = 200_000):
        super().__init__()
        self.limit = limit

    def __setitem__(self, key, value):
        if len(self) >= self.limit:
            self.clear()
        super().__setitem__(key, value)


_OUTPUTS, _PURE = Memo(), {}


class KnownShapes(TorchDispatchMode):
    """Memoizes pure aten operations on meta tensors by their arguments' shapes, strides and dtypes."""

    def __init__(self):
        super().__init__()
        self.known, self.pure = _OUTPUTS, _PURE
        self.hits = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        pure = self.pure.get(func)
        if pure is None:
            pure = self.pure[func] = _pure(func)
        key = shape_key(func, args, kwargs) if pure else None
        if key is None:
            return func(*args, **kwargs)
        spec = self.known.get(key, _MISSING)
        if spec is _MISSING:
            out = func(*args, **kwargs)
            inputs = {
                t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
            }
            self.known[key] = _spec(out, inputs)
            return out
        if spec is None:
            return func(*args, **kwargs)
        self.hits += 1
        return _build(spec)
