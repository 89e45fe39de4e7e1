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

`returns=` is a spec (`specs.py`), or a function `(case, rank, world_size) -> spec` of the grader's copy of the
case's inputs for that rank.
"""

from __future__ import annotations

import torch

from .specs import Spec, _opaque, _spec, seen

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
        raise ValueError(
            f"case {case!r}: inputs for {len(inputs)} ranks at world size {n}; give one dict per "
            "rank, or one dict for every rank"
        )
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
    """ ", case 'pp=2, microbatches=5'" for a check of several cases; "" for a check of one."""
    return f", case {case!r}" if isinstance(case, str) and case else ""


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
        if not isinstance(pairs, list) or not all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in pairs
        ):
            raise ContractBroken(
                f"rank {r} sent {seen(pairs)} instead of one [case id, observation] per case: "
                "the grader cannot tell which case an answer belongs to"
            )
        ids = [case for case, _ in pairs]
        missing = [c for c in drawn.ids if c not in ids]
        extra = [c for c in ids if c not in drawn.ids]
        twice = sorted({c for c in ids if ids.count(c) > 1})
        whose = "the task" if pure else f"rank {r}"
        if missing:
            raise ContractBroken(
                f"{whose} sent no observation for {_cases(missing)} of the {len(drawn.ids)} the "
                "grader drew: every case drawn is judged, and an unanswered one fails"
            )
        if extra:
            raise ContractBroken(f"{whose} sent observations for {_cases(extra)} that the grader never drew")
        if twice:
            raise ContractBroken(f"{whose} sent {_cases(twice)} more than once")
        if ids != drawn.ids:
            raise ContractBroken(
                f"{whose} sent the cases in another order ({ids[:6]}) than the grader drew them ({drawn.ids[:6]})"
            )
    found = {case: [None] * n for case in drawn.ids}
    for r in range(n):
        for case, value in sent[r]:
            spec = (
                returns(drawn.given(case)[r], r, n) if callable(returns) and not isinstance(returns, Spec) else returns
            )
            problem = _spec(spec).problem(value, "") if spec is not None else _opaque(value)
            if problem:
                where = _where(r, case, pure)
                raise ContractBroken(f"{where}: {problem}" if where else problem)
            found[case][r] = value
    return found


def _cases(ids) -> str:
    shown = [repr(c) if c else "its only case" for c in ids[:5]]
    return ("case " if len(ids) == 1 else "cases ") + ", ".join(shown) + (", ..." if len(ids) > 5 else "")
