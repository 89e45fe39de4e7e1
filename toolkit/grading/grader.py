"""Grade a lab: run its checks on real ranks against a student's file and report a score.

A lab folder holds `checks.py` (checks written with `toolkit.grading.check`) and the student's file
(`skeleton.py` unless told otherwise). For each world size the checks ask for, one `toolkit.launch`
runs them in order; every rank loads the student's module and the checks from their paths and
writes one small result file per check. A check passes when it passes on every rank at every world
size. How one failure is kept from spoiling the others:

- a check that raises or finds a wrong answer scores 0, with the message of the rank that failed first;
- each check talks over a fresh process group whose timeout is `check_timeout_s`: a rank stuck in a
  receive gives up, and a failed check's stray messages cannot reach the next check;
- after a check the ranks wait for each other; a rank whose check failed waits only a moment, then
  ends the launch, so a peer blocked in a receive that will never complete costs no timeout;
- when a launch ends early (that way, or a crash, or a hang), the result files show which check was
  running: it scores 0 with the launcher's story, and a new launch carries on after it.
A check that failed at a smaller world size is not run again at larger ones.

What a solution may cost (`Limits`; see `watchdog.py` and `isolation.py`): a check in which every rank
is blocked or done for `stall_s` is a deadlock, reported once with the line where each rank waits, and
the grading stops there (the rest would deadlock the same way); a check may run `time_limit_s`; a rank
may allocate `memory_limit_mb` more than it started the checks with; nothing the solution started survives.
"""
from __future__ import annotations

import collections
import contextlib
import datetime
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..runtime.launch import RankError, launch
from .checks import Check, CheckFailed, Context
from .isolation import Sandbox
from .watchdog import Watchdog, limit_memory, out_of_memory

PATIENCE_AFTER_FAILURE_S = 1.5  # how long a rank whose check failed waits for its peers before giving up
HIDDEN_CHECKS = "hidden_checks.py"  # the instructor's extra checks: graded, never released to students


@dataclass(frozen=True)
class Limits:
    """What grading one solution may cost. check_timeout_s: how long one rank waits for one message;
    stall_s: every rank blocked (or done) this long is a deadlock; time_limit_s: one check's wall time;
    memory_limit_mb: the data a rank may allocate beyond what it had when the checks began (None: no limit)."""

    check_timeout_s: float = 20.0
    stall_s: float = 5.0
    time_limit_s: float = 120.0
    memory_limit_mb: float | None = 4096


@dataclass
class CheckResult:
    name: str
    points: int
    earned: int
    message: str = ""  # why it failed (empty when it passed)
    hidden: bool = False  # from the instructor's hidden_checks.py

    @property
    def passed(self) -> bool:
        return not self.message


@dataclass
class Score:
    lab: str
    solution: str
    results: list[CheckResult] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(r.earned for r in self.results)

    @property
    def maximum(self) -> int:
        return sum(r.points for r in self.results)

    def __str__(self) -> str:
        return format_score(self)


def format_score(score: Score) -> str:
    """A report a student reads top to bottom: each check, its points, and why it failed."""
    lines = [f"Grading {score.solution}", f"  against {score.lab}/checks.py", ""]
    for r in score.results:
        mark = "PASS" if r.passed else "FAIL"
        lines.append(f"  {mark} [{r.earned}/{r.points}] {r.name}")
        lines += [f"         {line}" for line in r.message.splitlines()]
    lines += ["", f"Score: {score.total}/{score.maximum}"]
    return "\n".join(lines)


# --- loading ----------------------------------------------------------------------------------------
def load_module(path, name: str):
    """Import a Python file as a module (a student's solution, a lab's checks)."""
    spec = importlib.util.spec_from_file_location(name, str(path))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}: is it a Python file?")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # some code (dataclasses, pickling) looks itself up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def lab_checks(lab_dir) -> list[Check]:
    """The checks a lab's checks.py defines, in the order it defines them, then its hidden_checks.py's
    (present in the instructor's copy only: `python -m toolkit release` leaves it out)."""
    module = load_module(Path(lab_dir) / "checks.py", f"_lab_checks_{abs(hash(str(lab_dir)))}")
    checks = [value for value in vars(module).values() if isinstance(value, Check)]
    if not checks:
        raise ValueError(f"{lab_dir}/checks.py defines no checks (functions decorated with @check).")
    if (Path(lab_dir) / HIDDEN_CHECKS).exists():  # it may `from checks import ...` the public helpers
        before = sys.modules.get("checks")
        sys.modules["checks"] = module
        try:
            name = f"_lab_hidden_{abs(hash(str(lab_dir)))}"
            hidden = load_module(Path(lab_dir) / HIDDEN_CHECKS, name)
        finally:
            if before is None:
                sys.modules.pop("checks", None)
            else:
                sys.modules["checks"] = before
        checks += [replace(v, hidden=True) for v in vars(hidden).values()
                   if isinstance(v, Check) and v not in checks]
    return checks


# --- on every rank ----------------------------------------------------------------------------------
def _result_path(folder: str, index: int, rank: int) -> str:
    return os.path.join(folder, f"check-{index}-rank-{rank}.json")


def _explain(exc: BaseException, solution: str) -> str:
    """The exception in a student's words, with the line of their file where it happened."""
    cause = exc
    while cause is not None and not isinstance(cause, NotImplementedError):
        cause = cause.__cause__  # the collectives door wraps what an implementation raised
    if cause is not None:
        return f"not implemented yet ({cause})" if str(cause) else "not implemented yet"
    text = f"{type(exc).__name__}: {exc}".strip()
    if out_of_memory(exc):
        text = ("ran out of memory: the rank tried to allocate more than a check may use "
                f"(the grader's memory limit). {text.splitlines()[0][:200]}")
    mine = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.abspath(f.filename) == solution]
    if mine:
        text += f"\n  at {os.path.basename(solution)} line {mine[-1].lineno}: {(mine[-1].line or '').strip()}"
    return text


def _wait_for_peers(folder: str, index: int, world_size: int, patience_s: float | None) -> bool:
    """Wait until every rank has written its result of check `index`; False if patience ran out."""
    deadline = None if patience_s is None else time.monotonic() + patience_s
    while not all(os.path.exists(_result_path(folder, index, r)) for r in range(world_size)):
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def run_checks_on_rank(lab_dir: str, solution: str, indices: list[int], folder: str, limits: Limits):
    """The body of each rank: run the lab's checks `indices` on the student's module, writing results."""
    import torch
    import torch.distributed as dist

    from ..runtime import status

    rank, world_size = dist.get_rank(), dist.get_world_size()
    checks = lab_checks(lab_dir)
    watchdog = Watchdog(folder, rank, world_size, solution, lambda i, r: _result_path(folder, i, r),
                        limits.stall_s, limits.time_limit_s)
    student = load_module(solution, "student_solution")
    limit_memory(limits.memory_limit_mb)
    for index in indices:
        check = checks[index]
        group = dist.new_group(list(range(world_size)), timeout=datetime.timedelta(seconds=limits.check_timeout_s))
        torch.manual_seed(1000 + rank)
        status.enter(f"check '{check.name}'")
        watchdog.begin(index)
        try:
            check.fn(student, Context(rank, world_size, group))
            message = ""
        except Exception as exc:  # noqa: BLE001 - any failure is the student's to read
            message = str(exc) if isinstance(exc, CheckFailed) else f"rank {rank}: {_explain(exc, solution)}"
        status.leave()
        _write_json(_result_path(folder, index, rank), {"message": message, "time": time.time()})
        watchdog.end()
        # No board entry while waiting: a peer that never finishes is inside its check (the launcher
        # sees that one hang) or dead (the launcher sees that too).
        if not _wait_for_peers(folder, index, world_size, PATIENCE_AFTER_FAILURE_S if message else None):
            _write_json(os.path.join(folder, "abandoned.json"), {"index": index})
            raise RuntimeError(f"check '{check.name}' failed on rank {rank} while other ranks were still "
                               "inside it; stopping this launch")


def _write_json(path: str, value) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)  # readers never see half a file


def _read_json(path: str):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


# --- in the grader's process ------------------------------------------------------------------------
class _Tail:
    """Stands in for stdout during a launch: keeps the ranks' last lines, echoes them unless quiet."""

    def __init__(self, echo_to=None):
        self.lines = collections.deque(maxlen=400)
        self.echo_to = echo_to

    def write(self, text: str) -> None:
        self.lines.extend(line for line in text.splitlines() if line.strip())
        if self.echo_to is not None:
            self.echo_to.write(text)

    def flush(self) -> None:
        if self.echo_to is not None:
            self.echo_to.flush()

    def of_rank(self, rank: int, count: int = 3) -> list[str]:
        prefix = f"[rank {rank}] "
        return [line[len(prefix):] for line in self.lines if line.startswith(prefix)][-count:]


def _crash_story(error: RankError, tail: _Tail) -> str:
    """What ended a launch early, in a few lines: the launcher's summary and the rank's last words."""
    lines = str(error).splitlines()
    where = [line for line in lines[1:] if line.startswith("  rank ")]  # the launcher's "where every rank was"
    said = tail.of_rank(error.rank) if error.rank is not None else []
    story = "\n".join([lines[0]] + [f"  rank {error.rank} printed: {line}" for line in said]
                      + (["  where every rank was:"] + where if where else []))
    if "doesn't match expected size" in story:
        story += ("\n  hint: a rank received a bigger message than the buffer it posted: do sender and "
                  "receiver agree on which chunk moves at this step, and on its size?")
    return story


def _verdict(results: dict, n: int, crash_story: str | None) -> str:
    """One check at world size n: "" if it passed on every rank, else the first failure (in time)."""
    failed = {rank: v for rank, v in results.items() if v["message"]}
    if failed:  # the cause comes first; its echoes (a peer's broken connection) come seconds later
        earliest = min(v["time"] for v in failed.values())
        first = min(rank for rank, v in failed.items() if v["time"] < earliest + 0.5)
        others = sorted(set(failed) - {first})
        also = f" (rank{'s' * (len(others) > 1)} {', '.join(map(str, others))} failed too)" if others else ""
        return f"world size {n}, {failed[first]['message']}{also}"
    if len(results) < n:
        return f"world size {n}: {crash_story or 'the ranks stopped without a result'}"
    return ""


def _run_world_size(lab_dir: str, solution: str, indices: list[int], n: int, limits: Limits,
                    quiet: bool, backend: str) -> tuple[dict[int, str], int | None]:
    """Run checks `indices` on n ranks: ({index: failure message, or "" when it passed on every rank},
    the index of a check that deadlocked or ran out of time, after which nothing more runs)."""
    verdicts: dict[int, str] = {}
    todo = list(indices)
    while todo:
        with tempfile.TemporaryDirectory(prefix="toolkit-grade-") as folder:
            tail, crash = _Tail(None if quiet else sys.stdout), None
            if not quiet:
                print(f"grading: {len(todo)} check(s) on {n} ranks ...", file=sys.stderr, flush=True)
            with contextlib.redirect_stdout(tail):
                try:
                    launch(run_checks_on_rank, n, args=(lab_dir, solution, todo, folder, limits),
                           backend=backend, timeout_s=limits.check_timeout_s + 5,
                           deadline_s=len(todo) * (limits.time_limit_s + 5) + 60)
                except RankError as error:
                    crash = error
            stuck = _read_json(os.path.join(folder, "deadlock.json"))  # the watchdogs' verdict, if any
            if stuck is not None and stuck["stop"]:  # a deadlock: the next check would deadlock the same way
                verdicts[stuck["index"]] = f"world size {n}, {stuck['message']}"
                return verdicts, stuck["index"]
            abandoned = (_read_json(os.path.join(folder, "abandoned.json")) or {}).get("index")
            for position, index in enumerate(todo):
                results = {r: v for r in range(n) if (v := _read_json(_result_path(folder, index, r)))}
                verdicts[index] = _verdict(results, n, crash and _crash_story(crash, tail))
                if stuck is not None and stuck["index"] == index:  # stopped in this check: carry on after it
                    verdicts[index] = f"world size {n}, {stuck['message']}"
                    todo = todo[position + 1:]
                    break
                if len(results) < n or index == abandoned:  # the launch ended in this check
                    todo = todo[position + 1:]
                    break
            else:
                todo = []
    return verdicts, None


def grade(lab_dir, solution_file=None, *, check_timeout_s: float | None = None, quiet: bool = True,
          backend: str = "gloo", limits: Limits | None = None) -> Score:
    """Run every check of the lab in `lab_dir` against `solution_file` (default: the lab's skeleton.py).

    limits: what the solution may cost (`Limits()` by default); check_timeout_s overrides its
        `check_timeout_s`, how long one rank may wait for one message inside a check.
    quiet=False shows what the ranks print (a student's debugging output) while grading.
    backend: gloo by default, since the labs' checks build CPU tensors, even on a machine with GPUs.
    Whatever the solution started is stopped before this returns (`isolation.Sandbox`).
    """
    limits = limits or Limits()
    if check_timeout_s is not None:
        limits = replace(limits, check_timeout_s=check_timeout_s)
    lab_dir = Path(lab_dir).resolve()
    solution = Path(solution_file).resolve() if solution_file else lab_dir / "skeleton.py"
    if not (lab_dir / "checks.py").exists():
        raise FileNotFoundError(f"{lab_dir} is not a lab folder: it has no checks.py.")
    if not solution.exists():
        raise FileNotFoundError(f"no solution file at {solution}.")
    checks = lab_checks(lab_dir)
    score = Score(lab=str(lab_dir), solution=str(solution))
    with Sandbox():
        problem = _imports(solution)
        verdicts = {i: problem for i in range(len(checks))} if problem else {}
        stopped = None
        for n in sorted({n for c in checks for n in c.world_sizes}):
            indices = [i for i, c in enumerate(checks) if n in c.world_sizes and not verdicts.get(i)]
            if indices and stopped is None:
                found, stopped = _run_world_size(str(lab_dir), str(solution), indices, n, limits, quiet, backend)
                verdicts.update(found)
    for i, c in enumerate(checks):
        message = verdicts.get(i, "")
        if stopped is not None and i not in verdicts:
            message = (f"not run: grading stopped at check '{checks[stopped].name}', which could not finish "
                       "(see its message); fix that first.")
        score.results.append(CheckResult(c.name, c.points, 0 if message else c.points, message, c.hidden))
    return score


def _imports(solution: Path) -> str:
    """A file that does not import fails every check without starting a single rank. (In this process:
    a solution that misbehaves at import time is contained by the class grader's per-student process.)"""
    try:
        load_module(solution, "student_solution")
    except Exception as exc:  # noqa: BLE001
        return f"your file does not import: {_explain(exc, str(solution))}"
    return ""
