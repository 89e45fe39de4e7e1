"""What a lab's `checks.py` is written with: `@check`, the `Judge` a check receives, `CheckFailed`.

A check has two halves that never share a process:

- the **task**, a function of the lab's `tasks.py` (same name as the check unless `task=` says otherwise),
  runs on every rank next to the student's code, once per case, and returns what it observed (`on_rank.py`);
- the **judge**, the function decorated here, runs in the grader's process, once per case: it receives what
  it sent each rank for that case (`given[r]`, the grader's own copy) and what each rank observed (`got[r]`),
  computes the expected values itself and raises `CheckFailed` with a message a student can act on
  ("rank 1 got [...] expected [...]").

`inputs=` is the check's one case: a dict for every rank, a list with one dict per rank, or a function
`(n, generator)` giving either. `cases=` is several: a function `(n, generator)` giving {case id: inputs}.
The generator is seeded afresh for every grading, so a submission cannot compute another rank's inputs, or
the answers, without the messages. `returns=` declares what the task returns for a case (`contract.py`):
before any judge runs, the framework checks that every case drawn came back exactly once, from every rank,
of that type and shape.

    def _inputs(n, g):
        return {f"{numel} elements": [{"x": torch.randn(numel, generator=g)} for _ in range(n)]
                for numel in (1, 7)}

    @check("ring all-reduce, SUM, float32", points=2, world_sizes=(3, 4), cases=_inputs,
           returns=lambda case, r, n: {"x": like(case["x"])})
    def all_reduce_sum(ctx, given, got):
        expected = sum(g["x"] for g in given)
        for r in range(ctx.world_size):
            ctx.expect(got[r]["x"], expected, "all_reduce SUM", rank=r, exact=False)

A check passes when its judge returns on every case at every world size it asks for. Anything else (an
observation missing or malformed, the judge raises, a rank raised, crashed, hung or sent something
unreadable) is a failure with a message.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..units import seconds_text
from .contract import SINGLE, CheckFailed, Drawn, draw, observations


@dataclass(frozen=True)
class Check:
    """One graded property: its name, points, world sizes, the task the ranks run and the judge."""

    name: str
    points: int
    world_sizes: tuple[int, ...]
    judge: object
    task: str
    inputs: object = None
    hidden: bool = False  # defined in the lab's hidden_checks.py: graded, not shipped to students
    platform_only: bool = False  # a hidden check named in a students' copy (platform_checks.json): not run there
    feedback: str = ""  # for a hidden check, what a student reads when it fails (nothing else is shown)
    numbers_only: bool = False  # pure functions (numbers in, numbers out): no process group in the message
    cases: object = None  # several cases: (n, generator) -> {case id: inputs}
    returns: object = None  # what the task returns for one case (a spec of contract.py, or a function of the case)

    def make_inputs(self, n: int, generator: torch.Generator) -> Drawn:
        """The cases at world size n: `drawn[r]` is what rank r is sent, `drawn.given(case)` the grader's copy."""
        return draw(self.inputs, self.cases, n, generator)

    def verdict(self, n: int, drawn: Drawn, sent: list) -> None:
        """Judge what the ranks sent (sent[r]: rank r's [[case id, observation], ...]): the contract first, then
        the judge on every case; raises CheckFailed saying what is wrong."""
        got = observations(drawn, sent, self.returns, self.pure)
        for case in drawn.ids:
            self.judge(Judge(n, case), drawn.given(case), got[case])

    @property
    def pure(self) -> bool:
        """Tests pure functions (or runs on one rank): its messages name no world size and no rank."""
        return self.numbers_only or self.world_sizes == (1,)


def check(
    name: str,
    points: int = 1,
    world_sizes=(2, 3, 4),
    *,
    task: str | None = None,
    inputs=None,
    cases=None,
    returns=None,
    feedback: str = "",
    pure: bool = False,
):
    """Decorator that makes a judge `fn(ctx, given, got)` a graded check of a lab (see the module docstring).
    pure=True: the task calls pure functions (run beside the lab's other checks, at their world size), so the
    messages name no world size."""
    if points < 0 or not world_sizes or min(world_sizes) < 1:
        raise ValueError(f"check {name!r}: points must be >= 0 and world sizes positive.")
    if inputs is not None and cases is not None:
        raise ValueError(f"check {name!r}: give inputs= (one case) or cases= (several), not both.")

    def make(fn) -> Check:
        return Check(
            name,
            points,
            tuple(sorted(set(world_sizes))),
            fn,
            task or fn.__name__,
            inputs,
            feedback=feedback,
            numbers_only=pure,
            cases=cases,
            returns=returns,
        )

    return make


PLATFORM_CHECKS = "platform_checks.json"  # in a students' copy: the hidden checks' names and points (release.py)
PLATFORM_ONLY = "graded on the course platform only: its check is not in your copy of the lab"


def platform_only(path) -> list[Check]:
    """The hidden checks a students' copy names (`platform_checks.json`, written by the release): shown, never run."""
    import json

    listed = json.loads(path.read_text())
    return [
        Check(str(c["name"]), int(c["points"]), tuple(c["world_sizes"]), None, "", hidden=True, platform_only=True)
        for c in listed
    ]


def sibling(checks_file: str, name: str = "tasks.py"):
    """A file beside a lab's checks.py, imported (its tasks.py, say, when a judge rebuilds what a task built
    from its inputs: the same gate, the same order). Lab code, trusted; never the student's file."""
    import importlib.util
    from pathlib import Path

    path = Path(checks_file).with_name(name)
    spec = importlib.util.spec_from_file_location(f"_lab_{path.parent.name}_{path.stem}".replace("-", "_"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def show(t, limit: int = 6) -> str:
    """A short, readable rendering of a tensor's (or a list's) values."""
    values = t.detach().flatten().tolist() if isinstance(t, torch.Tensor) else list(t)
    text = ", ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in values[:limit])
    return f"[{text}{', ...' if len(values) > limit else ''}]"


def number(x) -> str:
    """A number as a person reads it (6 significant digits, no float repr); anything else as a short repr."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        text = repr(x)
        return text if len(text) < 80 else text[:77] + "..."
    return f"{x:.6g}" if isinstance(x, float) else str(x)


def seconds(x) -> str:
    """A duration with its unit by magnitude, precise enough to tell two close answers apart."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return number(x)
    return seconds_text(float(x), digits=6)


@dataclass
class Judge:
    """What a judge receives: the world size, and the comparisons that explain a failure."""

    world_size: int
    case: str = SINGLE  # the id of the case being judged ("" for a check of one case)

    def fail(self, message: str):
        raise CheckFailed(message)

    def tensor(self, got, what: str, rank: int | None = None) -> torch.Tensor:
        """`got` if it is a tensor, else a failure that says what it was."""
        if not isinstance(got, torch.Tensor):
            self.fail(f"{what}: {_on(rank)}got {number(got)}, expected a tensor")
        return got

    def expect(
        self,
        got,
        expected: torch.Tensor,
        what: str,
        *,
        rank: int | None = None,
        exact: bool = True,
        rtol: float = 1e-5,
        atol: float = 1e-5,
    ) -> None:
        """Raise CheckFailed unless `got` equals `expected` (exactly, or within tolerances)."""
        got = self.tensor(got, what, rank)
        if got.shape != expected.shape or got.dtype != expected.dtype:
            self.fail(
                f"{what}: {_on(rank)}got shape {tuple(got.shape)} {got.dtype}, "
                f"expected shape {tuple(expected.shape)} {expected.dtype}"
            )
        same = got == expected if exact else torch.isclose(got, expected, rtol=rtol, atol=atol)
        if bool(same.all()):
            return
        wrong = (~same).flatten().nonzero().flatten()
        first = int(wrong[0])
        self.fail(
            f"{what}: {_on(rank)}got {show(got)} expected {show(expected)} "
            f"({len(wrong)} of {got.numel()} elements differ; first at element {first}: "
            f"{got.flatten()[first].item():.6g} instead of {expected.flatten()[first].item():.6g})"
        )

    def over_everyone(self, carried: list, what: str, rank: int) -> None:
        """Fail unless every collective the grader's relay `carried` for `rank` spans all the check's ranks: a
        collective over a group of one rank's own is a true record, and moves nothing."""
        everyone = list(range(self.world_size))
        for event in carried:
            if event["args"]["group"] != everyone:
                self.fail(
                    f"rank {rank}: {what}: the grader's relay carried its {event['name']} over ranks "
                    f"{event['args']['group']}, not over all {self.world_size} ranks (the group the task handed in)"
                )


def _on(rank) -> str:
    return "" if rank is None else f"rank {rank} "
