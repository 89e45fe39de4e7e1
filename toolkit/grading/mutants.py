"""How well a lab's checks tell right from nearly right: its reference's mutants (`mutation.py`) graded by its visible
and hidden checks together.

    python -m toolkit.grading.mutants labs/                          # every lab: the table, the survivors
    python -m toolkit.grading.mutants labs/ --labs 12-pipeline --limit 10
    python -m toolkit.grading.mutants labs/ --write                  # and the table in labs/README.md
    make test-mutants                                                # every lab, failing under 90% or on a
                                                                     # survivor nobody explained

A mutant is killed when a check fails on it (a wrong answer, an error, a crash, a hang: what a student would lose
points for). A survivor is either a hole in the checks (close it with a check) or equivalent to the reference (it
computes the same thing another way), listed with why in the lab's `equivalent_mutants.md` (instructor only: it
quotes the reference). The score is killed / (mutants - equivalent).

Many mutants per grading. The mutants are the course's own code, not a student's, so one launch of ranks runs a check
for every mutant still alive: a tasks.py made here holds the lab's tasks and every mutant, and its task
`m<k>__<task>` is the lab's task with mutant k as the student (the ranks' isolation and limits are the grading's
own; a real submission is never graded this way). Checks run one after the other, the pure ones first, each at its
world sizes; a mutant leaves at the first check that fails it, so most run one or two checks. A mutant that
deadlocks or crashes ends its launch; a new launch goes on after it. The inputs come from a fixed seed, the same
for every mutant: a survivor is a survivor of those inputs (the grading draws new ones each time).
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..runtime import interrupts
from . import mutation
from .box import Box
from .declared import declared
from .grader import lab_checks
from .isolation import Sandbox
from .limits import Limits
from .runner import IMPORT
from .session import launch_ranks
from .verdicts import first_failure, relayed, verdict

LIMITS = Limits(check_timeout_s=30.0, stall_s=5.0, time_limit_s=120.0)  # the grading's, with room for a loaded machine
EQUIVALENT = "equivalent_mutants.md"  # in a lab: "- `<mutant id>`: why it computes what the reference does"
TARGET = 0.9
TABLE = re.compile(r"(<!-- mutants -->\n).*?(<!-- /mutants -->)", re.S)
WRAPPER = '''"""The lab's tasks, with each mutant of its reference as the student (toolkit.grading.mutants)."""
import sys
import types

TASKS_SOURCE = {tasks!r}
MUTANTS = {mutants!r}
_made = {{}}


def _module(name, source, filename):
    module = types.ModuleType(name)
    module.__file__ = filename
    sys.modules[name] = module
    exec(compile(source, filename, "exec"), module.__dict__)
    return module


_tasks = _module("lab_tasks_real", TASKS_SOURCE, {tasks_file!r})


def _mutant(k):
    if k not in _made:
        _made[k] = _module(f"mutant_{{k}}", MUTANTS[k], f"mutant-{{k}}.py")
    return _made[k]


def __getattr__(name):
    k, _, task = name.partition("__")
    if not k.startswith("m") or not task:
        raise AttributeError(name)
    real = getattr(_tasks, task)
    return lambda student, rank, given: real(_mutant(int(k[1:])), rank, given)
'''


@dataclass
class LabResult:
    lab: str
    mutants: list
    killed: dict = field(default_factory=dict)  # mutant id -> the check that killed it, and its first line
    equivalent: dict = field(default_factory=dict)  # mutant id -> why (equivalent_mutants.md)
    seconds: float = 0.0

    @property
    def survivors(self) -> list:
        return [m.id for m in self.mutants if m.id not in self.killed and m.id not in self.equivalent]

    @property
    def score(self) -> float:
        judged = len(self.mutants) - len(
            [m for m in self.mutants if m.id in self.equivalent and m.id not in self.killed]
        )
        return len(self.killed) / judged if judged else 1.0


def equivalents(lab: Path) -> dict:
    """{mutant id: why} from the lab's equivalent_mutants.md ("- `id`: why" per line)."""
    path = lab / EQUIVALENT
    if not path.exists():
        return {}
    return {m.group(1): m.group(2) for m in re.finditer(r"^- `(.+?)`: (.+)$", path.read_text(), re.M)}


def lab_mutants(lab: Path) -> list:
    """The lab's mutants, each id unique (a second identical description gets "(2)")."""
    found, seen = [], {}
    for m in mutation.mutants((lab / "solution.py").read_text(), (lab / "skeleton.py").read_text()):
        seen[m.id] = seen.get(m.id, 0) + 1
        found.append(m if seen[m.id] == 1 else replace(m, what=f"{m.what} ({seen[m.id]})"))
    return found


def _ordered(checks) -> list:
    """Pure checks first (numbers in, numbers out: cheap), then the others in the lab's order."""
    return sorted(checks, key=lambda c: (not c.pure, min(c.world_sizes)))


def run_lab(lab: Path, chosen=None, *, seed: int = 0, quiet: bool = True) -> LabResult:
    """Grade `chosen` mutants (default: all) of `lab`'s reference with its visible and hidden checks."""
    lab = Path(lab).resolve()
    every = lab_mutants(lab)
    mutants = every if chosen is None else [m for m in every if m.id in chosen]
    result = LabResult(
        lab.name, mutants, equivalent={k: v for k, v in equivalents(lab).items() if k in {m.id for m in mutants}}
    )
    checks, _ = lab_checks(lab)
    messages_only = bool(declared(lab, "MESSAGES_ONLY", False))  # as a grading: what the relay carries
    started = time.monotonic()
    reference = mutation.Mutant("(the reference)", 0, "unchanged", (lab / "solution.py").read_text())
    pool = [reference] + mutants  # the reference first: a check it fails would make every kill meaningless
    with tempfile.TemporaryDirectory(prefix="toolkit-mutants-") as tmp:
        shutil.copy(lab / "checks.py", Path(tmp) / "checks.py")  # its ANSWERS: the students' build the ranks import
        (Path(tmp) / "tasks.py").write_text(
            WRAPPER.format(
                tasks=(lab / "tasks.py").read_text(),
                tasks_file=str(lab / "tasks.py"),
                mutants={k: m.source for k, m in enumerate(pool)},
            )
        )
        source = (lab / "solution.py").read_bytes()
        with interrupts.held(), Sandbox() as marked, Box(Path(tmp), source, "solution.py") as box, interrupts.taken():
            alive = list(range(len(pool)))
            for check in _ordered(checks):
                for n in check.world_sizes:
                    if alive == [0]:  # every mutant killed: nothing left to tell from the reference
                        break
                    verdicts = _run(box, check, n, alive, seed, marked.id, messages_only)
                    if verdicts.get(0):  # once more, in case the machine was too busy for the reference's deadline
                        verdicts = _run(box, check, n, alive, seed, marked.id, messages_only)
                    if verdicts.get(0):
                        raise RuntimeError(
                            f"{lab.name}: the reference fails '{check.name}' at world size {n} with the "
                            f"mutation run's inputs: {verdicts[0][:500]}"
                        )
                    for k, message in verdicts.items():
                        if message and k:
                            result.killed[pool[k].id] = (
                                f"{check.name} (world size {n}): {message.splitlines()[0][:160]}"
                            )
                    alive = [k for k in alive if not verdicts.get(k)]
                    if not quiet:
                        print(
                            f"{lab.name}: {check.name[:50]} at {n}: {len(alive) - 1} of {len(mutants)} alive",
                            file=sys.stderr,
                            flush=True,
                        )
    result.seconds = time.monotonic() - started
    return result


def _run(box: Box, check, n: int, alive: list, seed: int, grading_id: str, messages_only: bool) -> dict:
    """{mutant k: "" or why `check` fails it at world size n}, for every k in `alive`, in as few launches as hangs
    and crashes allow."""
    from .grader import _generator

    drawn = check.make_inputs(n, _generator(seed, check, n))
    virtual = {k: replace(check, task=f"m{k}__{check.task}") for k in alive}
    verdicts, todo = {}, list(alive)
    while todo:
        found = launch_ranks(
            box,
            n,
            todo,
            {k: virtual[k].task for k in todo},
            {k: drawn for k in todo},
            [],
            LIMITS,
            backend="gloo",
            quiet=True,
            grading_id=grading_id,
            messages_only=messages_only,
        )
        imported = found.results[IMPORT]
        if first_failure(imported) or len(imported) < n:
            raise RuntimeError(f"the mutants' tasks could not be imported on {n} ranks: {found.lines[-20:]}")
        stuck = found.stuck
        for position, k in enumerate(todo):
            results = relayed(found.results.get(k, {}), found, k)  # the traffic a check reads: the relay's record
            verdicts[k] = verdict(virtual[k], n, drawn, results, found)
            if stuck is not None and stuck["index"] == k:
                verdicts[k] = verdicts[k] or f"a deadlock: {stuck['message'][:300]}"
                todo = todo[position + 1 :]
                break
            if len(results) < n or k == found.abandoned:
                verdicts[k] = verdicts[k] or "the ranks stopped in this check"
                todo = todo[position + 1 :]
                break
        else:
            todo = []
    return verdicts


# --- the table --------------------------------------------------------------------------------------------------
def table(results: list) -> str:
    rows = [
        "| lab | mutants | killed | equivalent | survivors | score | run (wall) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        rows.append(
            f"| {r.lab} | {len(r.mutants)} | {len(r.killed)} | {len(r.equivalent)} | {len(r.survivors)} | "
            f"{r.score:.0%} | {r.seconds:.0f} s |"
        )
    return "\n".join(rows) + "\n"


def write_table(readme: Path, text: str) -> None:
    current = readme.read_text()
    if not TABLE.search(current):
        raise ValueError(f"{readme} has no <!-- mutants --> ... <!-- /mutants --> block to write the table into")
    readme.write_text(TABLE.sub(lambda m: m.group(1) + text + m.group(2), current))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m toolkit.grading.mutants", description="Grade every lab's reference mutants with its checks."
    )
    parser.add_argument("labs", help="the instructor's labs folder, e.g. labs/")
    parser.add_argument("--labs", dest="names", nargs="+", metavar="LAB", help="only these labs (folder names)")
    parser.add_argument("--limit", type=int, help="only the first LIMIT mutants of each lab (a quick look)")
    parser.add_argument("--write", action="store_true", help="write the table into the labs folder's README.md")
    parser.add_argument("--readme", help="with --write: this README instead (it holds a <!-- mutants --> block)")
    parser.add_argument(
        "--check",
        action="store_true",
        help=f"exit 1 when a lab scores under {TARGET:.0%}% or a survivor is not explained",
    )
    args = parser.parse_args(argv)
    root = Path(args.labs)
    labs = sorted(p for p in root.iterdir() if (p / "solution.py").exists() and (p / "checks.py").exists())
    if args.names:
        unknown = sorted(set(args.names) - {p.name for p in labs})
        if unknown:
            print(f"error: no lab named {unknown} in {root}", file=sys.stderr)
            return 2
        labs = [p for p in labs if p.name in args.names]
    results = []
    for lab in labs:
        chosen = None if args.limit is None else {m.id for m in lab_mutants(lab)[: args.limit]}
        result = run_lab(lab, chosen, quiet=False)
        results.append(result)
        print(
            f"{lab.name}: {len(result.killed)} of {len(result.mutants)} killed, {len(result.equivalent)} equivalent, "
            f"score {result.score:.0%}, {result.seconds:.0f} s",
            flush=True,
        )
        for survivor in result.survivors:
            print(f"  survived: {survivor}", flush=True)
    print(table(results))
    if args.write:
        write_table(Path(args.readme) if args.readme else root / "README.md", table(results))
    failing = [r.lab for r in results if r.score < TARGET or r.survivors]
    if args.check and failing:
        print(f"under {TARGET:.0%} or with unexplained survivors: {failing}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
