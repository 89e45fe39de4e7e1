"""The contract between what the grader asks and what the ranks answer, kept by the framework for every lab.

A check asks one or more **cases**: `inputs=` is one case, `cases=` several, each with an id the grader
chooses ("pp=2, microbatches=5", say). The ranks run the check's task once per case (`run_cases`) and send
back one observation per case, keyed by its id. Before any judge runs, the grader's side (`observations`)
checks, rank by rank, that every case it drew came back exactly once, in the order it drew them, and nothing
else; and that each observation has the type and shape the check declares (`returns=`, written with `like`,
`Tensor`, `List`, ... below). A missing, extra, repeated, reordered or malformed observation fails the
check with a message naming the case, the rank and the part that is wrong. Only then is the judge called,
once per case, with the grader's own copy of that case's inputs (never what a rank had or said it had)
and the observations that passed.

So no judge pairs cases with answers by position, and a rank that empties, reorders or rewrites its own
copy of the inputs gains nothing: the grader judges the cases it drew, on the inputs it kept.

Specs (`returns=`): a spec, or a function `(case, rank, world_size) -> spec` of the grader's copy of the
case's inputs for that rank. Python's own types stand for themselves (`float` is any real number, `int`
an integer, `bool`, `str`, `None`); a dict literal is a dict with exactly those keys; `[spec]` a list of any
length, `List(spec, n)` of exactly n, `(a, b)` a list of exactly those items; `Tensor(shape, dtype)` (None
for any), `like(t)` a tensor of t's shape and dtype; `Keys(names, spec)` a dict with exactly those keys,
each value `spec`; `Maybe(spec)` the spec or None; `Either(a, b)`. `why=` on List, Tensor and Keys adds
the sentence a student needs ("each action is Action(kind, micro, stage)").
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SINGLE = ""  # the id of a check's only case (`inputs=`): its messages name no case


class CheckFailed(AssertionError):
    """The student's answer is wrong; the message says what differs, on which rank."""


class ContractBroken(CheckFailed):
    """What a rank sent is not one well-formed observation per case the grader drew."""


# --- the cases a check draws ------------------------------------------------------------------------------
class Drawn:
    """The cases drawn for one check at one world size: ids in order, and each rank's inputs for each.
    `drawn[r]` is what rank r is sent (a list of [id, inputs]); `drawn.given(id)` the grader's own copy, one
    entry per rank."""

    def __init__(self, cases: dict, n: int):
        self.ids = list(cases)
        self._per_rank = {case: _per_rank(inputs, n, case) for case, inputs in cases.items()}
        self.world_size = n

    def __getitem__(self, rank: int) -> list:
        return [[case, self._per_rank[case][rank]] for case in self.ids]

    def given(self, case: str) -> list:
        return self._per_rank[case]


def _per_rank(inputs, n: int, case: str) -> list:
    if isinstance(inputs, dict):
        return [dict(inputs) for _ in range(n)]
    inputs = list(inputs)
    if len(inputs) != n:
        raise ValueError(f"case {case!r}: inputs for {len(inputs)} ranks at world size {n}; give one dict per "
                         "rank, or one dict for every rank")
    return inputs


def draw(inputs, cases, n: int, generator: torch.Generator) -> Drawn:
    """The cases of a check at world size n: `cases(n, g)` -> {id: inputs} (or a list: ids "case 1", ...), or
    one case from `inputs` (a dict, a list with one dict per rank, or a function of (n, g) giving either)."""
    if cases is not None:
        made = cases(n, generator) if callable(cases) else cases
        if not isinstance(made, dict):
            made = {f"case {k + 1}": c for k, c in enumerate(made)}
        if not made or not all(isinstance(k, str) and k for k in made):
            raise ValueError("cases= must give at least one case, each under a non-empty string id")
        return Drawn(made, n)
    made = inputs(n, generator) if callable(inputs) else (inputs or {})
    return Drawn({SINGLE: made}, n)


def run_cases(task, student, rank, cases) -> tuple[list, str | None, BaseException | None]:
    """On a rank: the task on each case it was sent, in order: ([[id, observation], ...], the id of the case
    that raised and its exception, or None, None). Stops at the first case that raises (the check has failed;
    its peers may be waiting inside that case)."""
    done = []
    for case, inputs in cases:
        try:
            done.append([case, task(student, rank, inputs)])
        except BaseException as exc:  # noqa: BLE001 - the caller explains it to the student
            return done, case, exc
    return done, None, None


def in_case(case) -> str:
    """", case 'pp=2, microbatches=5'" for a check of several cases; "" for a check of one."""
    return f", case {case!r}" if isinstance(case, str) and case else ""


# --- what an observation must look like ----------------------------------------------------------------------
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
FINITE = _Scalar("a finite number", lambda v: _real(v) and math.isfinite(v))


@dataclass(frozen=True)
class Tensor(Spec):
    """A tensor; shape: a tuple (None for a dimension of any size) or None (any shape); dtype or None."""

    shape: tuple | None = None
    dtype: torch.dtype | None = None
    why: str = ""

    def problem(self, value, path):
        fits = isinstance(value, torch.Tensor) and (self.dtype is None or value.dtype == self.dtype) and (
            self.shape is None or (value.dim() == len(self.shape)
                                   and all(s is None or s == d for s, d in zip(self.shape, value.shape))))
        return None if fits else _wrong(path, value, self.describe(), self.why)

    def describe(self):
        shape = "" if self.shape is None else " of shape (" + ", ".join(
            "any" if s is None else str(s) for s in self.shape) + ("," if len(self.shape) == 1 else "") + ")"
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
            said = (f"lacks {missing}" if missing else "") + (" and " if missing and unknown and not self.extra
                                                               else "") + \
                (f"has keys nobody asked for {unknown[:5]}" if unknown and not self.extra else "")
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


# --- the grader's side: observations checked against the cases drawn -----------------------------------------
def _where(rank: int, case: str, pure: bool) -> str:
    parts = ([] if pure else [f"rank {rank}"]) + ([f"case {case!r}"] if case else [])
    return ", ".join(parts)


def observations(drawn: Drawn, sent: list, returns, pure: bool = False) -> dict:
    """{case id: [rank 0's observation, ...]} once every rank sent exactly one well-formed observation per case
    drawn, in order; else ContractBroken saying what is wrong. sent[r]: what rank r's task loop sent."""
    n = drawn.world_size
    for r in range(n):
        pairs = sent[r]
        if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                                                  for p in pairs):
            raise ContractBroken(f"rank {r} sent {seen(pairs)} instead of one [case id, observation] per case: "
                                 "the grader cannot tell which case an answer belongs to")
        ids = [case for case, _ in pairs]
        missing = [c for c in drawn.ids if c not in ids]
        extra = [c for c in ids if c not in drawn.ids]
        twice = sorted({c for c in ids if ids.count(c) > 1})
        whose = "the task" if pure else f"rank {r}"
        if missing:
            raise ContractBroken(f"{whose} sent no observation for {_cases(missing)} of the {len(drawn.ids)} the "
                                 "grader drew: every case drawn is judged, and an unanswered one fails")
        if extra:
            raise ContractBroken(f"{whose} sent observations for {_cases(extra)} that the grader never drew")
        if twice:
            raise ContractBroken(f"{whose} sent {_cases(twice)} more than once")
        if ids != drawn.ids:
            raise ContractBroken(f"{whose} sent the cases in another order ({ids[:6]}) than the grader drew them "
                                 f"({drawn.ids[:6]})")
    found = {case: [None] * n for case in drawn.ids}
    for r in range(n):
        for case, value in sent[r]:
            spec = returns(drawn.given(case)[r], r, n) if callable(returns) and not isinstance(returns, Spec) \
                else returns
            problem = _spec(spec).problem(value, "") if spec is not None else _opaque(value)
            if problem:
                where = _where(r, case, pure)
                raise ContractBroken(f"{where}: {problem}" if where else problem)
            found[case][r] = value
    return found


def _cases(ids) -> str:
    shown = [repr(c) if c else "its only case" for c in ids[:5]]
    return ("case " if len(ids) == 1 else "cases ") + ", ".join(shown) + (", ..." if len(ids) > 5 else "")


def _opaque(value, path="") -> str | None:
    """Without a declared spec: plain values only (no object the wire could not carry)."""
    if isinstance(value, list):
        return _first(_opaque(v, _index(path, k)) for k, v in enumerate(value))
    if isinstance(value, dict):
        return _first(_opaque(v, _key(path, k)) for k, v in value.items())
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return None
    return f"{_shown(path)} is {seen(value)}, which the grader cannot judge"
