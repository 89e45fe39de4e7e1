"""What an observation must look like: the specs a check's `returns=` is written with (`contract.py` holds every
case's answer to one before any judge runs).

Python's own types stand for themselves (`float` is any real number, `int` an integer, `bool`, `str`, `None`); a
dict literal is a dict with exactly those keys; `[spec]` a list of any length, `List(spec, n)` of exactly n, `(a,
b)` a list of exactly those items; `Tensor(shape, dtype)` (None for any), `like(t)` a tensor of t's shape and
dtype; `Keys(names, spec)` a dict with exactly those keys, each value `spec`; `Fields({...}, extra=True)` a dict
with at least those keys; `Maybe(spec)` the spec or None; `Either(a, b)`. `why=` on List, Items, Tensor, Fields
and Keys adds the sentence a student needs ("each action is Action(kind, micro, stage)").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class Spec:
    """The type and shape an observation (or a part of one) must have."""

    def problem(self, value, path: str) -> str | None:
        """None when `value` fits; else what is wrong with it, naming `path`."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


def _spec(s) -> Spec:
    """A spec from its short forms (types, dict, list and tuple literals, None)."""
    if isinstance(s, Spec):
        return s
    if s is None:
        return _Exactly(None, "None")
    if isinstance(s, type) and s in _SCALARS:
        return _SCALARS[s]
    if isinstance(s, dict):
        return Fields(s)
    if isinstance(s, list) and len(s) == 1:
        return List(s[0])
    if isinstance(s, tuple):
        return Items(*s)
    raise TypeError(f"not a spec of an observation: {s!r}")


def seen(value) -> str:
    """What a value is, in a few words: "a list of 3 items", "a tensor of shape (2, 4) float32", "None"."""
    if value is None:
        return "None"
    if isinstance(value, bool):
        return f"a bool ({value})"
    if isinstance(value, (int, float)):
        return f"a number ({value:.6g})" if isinstance(value, float) else f"an int ({value})"
    if isinstance(value, str):
        return f"a str ({value[:40]!r})"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, list):
        return f"a list of {len(value)} item{'s' * (len(value) != 1)}"
    if isinstance(value, dict):
        keys = ", ".join(repr(k) for k in list(value)[:6]) + (", ..." if len(value) > 6 else "")
        return f"a dict with keys {keys}" if value else "an empty dict"
    return f"{type(value).__name__} {str(value)[:80]}"  # wire.Opaque: "<a Foo: ...>"


class _Scalar(Spec):
    def __init__(self, name: str, accepts):
        self.name, self.accepts = name, accepts

    def problem(self, value, path):
        return None if self.accepts(value) else f"{_shown(path)} is {seen(value)}, expected {self.name}"

    def describe(self):
        return self.name


class _Exactly(Spec):
    def __init__(self, value, name):
        self.value, self.name = value, name

    def problem(self, value, path):
        return None if value is self.value else f"{_shown(path)} is {seen(value)}, expected {self.name}"

    def describe(self):
        return self.name


def _real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_SCALARS = {
    float: _Scalar("a number", _real),
    int: _Scalar("an int", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    bool: _Scalar("a bool", lambda v: isinstance(v, bool)),
    str: _Scalar("a str", lambda v: isinstance(v, str)),
}


@dataclass(frozen=True)
class Tensor(Spec):
    """A tensor; shape: a tuple (None for a dimension of any size) or None (any shape); dtype or None."""

    shape: tuple | None = None
    dtype: torch.dtype | None = None
    why: str = ""

    def problem(self, value, path):
        fits = (
            isinstance(value, torch.Tensor)
            and (self.dtype is None or value.dtype == self.dtype)
            and (
                self.shape is None
                or (
                    value.dim() == len(self.shape) and all(s is None or s == d for s, d in zip(self.shape, value.shape))
                )
            )
        )
        return None if fits else _wrong(path, value, self.describe(), self.why)

    def describe(self):
        shape = (
            ""
            if self.shape is None
            else " of shape ("
            + ", ".join("any" if s is None else str(s) for s in self.shape)
            + ("," if len(self.shape) == 1 else "")
            + ")"
        )
        dtype = "" if self.dtype is None else " " + str(self.dtype).removeprefix("torch.")
        return f"a tensor{shape}{dtype}"


def like(t: torch.Tensor, why: str = "") -> Tensor:
    """A tensor of t's shape and dtype."""
    return Tensor(tuple(t.shape), t.dtype, why)


def _wrong(path, value, expected, why) -> str:
    return f"{_shown(path)} is {seen(value)}, expected {expected}" + (f": {why}" if why else "")


def _shown(path: str) -> str:
    return path or "the observation"


def _key(path: str, key) -> str:
    """The path to a dict's entry: `lists`, `state['fc.weight']`."""
    return str(key) if not path and isinstance(key, str) else f"{path}[{key!r}]"


def _index(path: str, k: int) -> str:
    return f"{path}[{k}]" if path else f"item {k}"


class List(Spec):
    """A list (a tuple crosses the wire as one) of `item`s; `length`: exactly that many (None: any)."""

    def __init__(self, item, length: int | None = None, why: str = ""):
        self.item, self.length, self.why = _spec(item), length, why

    def problem(self, value, path):
        if not isinstance(value, list) or (self.length is not None and len(value) != self.length):
            return _wrong(path, value, self.describe(), self.why)
        return _first(self.item.problem(v, _index(path, k)) for k, v in enumerate(value))

    def describe(self):
        count = "" if self.length is None else f" of {self.length}"
        return f"a list{count} ({self.item.describe()} each)"


class Items(Spec):
    """A list of exactly these items, in this order."""

    def __init__(self, *items, why: str = ""):
        self.items, self.why = [_spec(i) for i in items], why

    def problem(self, value, path):
        if not isinstance(value, list) or len(value) != len(self.items):
            return _wrong(path, value, self.describe(), self.why)
        return _first(s.problem(v, _index(path, k)) for k, (s, v) in enumerate(zip(self.items, value)))

    def describe(self):
        return f"a list of {len(self.items)}: (" + ", ".join(s.describe() for s in self.items) + ")"


class Fields(Spec):
    """A dict with exactly these keys (`extra=True`: at least these), each value of its own spec."""

    def __init__(self, fields: dict, extra: bool = False, why: str = ""):
        self.fields, self.extra, self.why = {k: _spec(v) for k, v in fields.items()}, extra, why

    def problem(self, value, path):
        if not isinstance(value, dict):
            return _wrong(path, value, self.describe(), self.why)
        missing = [k for k in self.fields if k not in value]
        unknown = [k for k in value if k not in self.fields]
        if missing or (unknown and not self.extra):
            said = (
                (f"lacks {missing}" if missing else "")
                + (" and " if missing and unknown and not self.extra else "")
                + (f"has keys nobody asked for {unknown[:5]}" if unknown and not self.extra else "")
            )
            return f"{_shown(path)} {said}; expected {self.describe()}" + (f": {self.why}" if self.why else "")
        return _first(spec.problem(value[k], _key(path, k)) for k, spec in self.fields.items())

    def describe(self):
        return "a dict with keys " + ", ".join(map(repr, self.fields)) + (" (and any others)" if self.extra else "")


def Keys(names, value, why: str = "") -> Fields:
    """A dict with exactly the keys `names`, every value `value` (parameter names -> tensors, say)."""
    return Fields({name: value for name in names}, why=why)


class Maybe(Spec):
    def __init__(self, spec):
        self.spec = _spec(spec)

    def problem(self, value, path):
        return None if value is None else self.spec.problem(value, path)

    def describe(self):
        return f"{self.spec.describe()} or None"


class Either(Spec):
    def __init__(self, *specs):
        self.specs = [_spec(s) for s in specs]

    def problem(self, value, path):
        problems = [s.problem(value, path) for s in self.specs]
        return None if any(p is None for p in problems) else _wrong(path, value, self.describe(), "")

    def describe(self):
        return " or ".join(s.describe() for s in self.specs)


def _first(problems):
    return next((p for p in problems if p is not None), None)


def _opaque(value, path="") -> str | None:
    """Without a declared spec: plain values only (no object the wire could not carry)."""
    if isinstance(value, list):
        return _first(_opaque(v, _index(path, k)) for k, v in enumerate(value))
    if isinstance(value, dict):
        return _first(_opaque(v, _key(path, k)) for k, v in value.items())
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return None
    return f"{_shown(path)} is {seen(value)}, which the grader cannot judge"
