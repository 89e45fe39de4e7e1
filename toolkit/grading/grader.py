"""Grade a lab: the student's code runs in processes of its own; this process alone decides the score.

A lab folder holds `checks.py` (the judges, written with `toolkit.grading.check`; with `hidden_checks.py`
on the instructor's side), `tasks.py` (what the ranks run next to the student's code) and the student's
file (`skeleton.py` unless told otherwise). In this process, nothing of the student's runs: the file is
read as bytes (never through a link), parsed (not run) to find a syntax error or a use of the lab's answers
(`delegation.py`), and copied into a folder of its own (`box.Box`) with the students' build of the toolkit
(`student_wheel.for_lab`); a machine that cannot give it the sandbox promised refuses first (`sandbox.preflight`).
For each world size the checks ask for, the ranks start there (`session.launch_ranks`), run every check's task
on inputs made here with a seed drawn for this grading, and send back what they observed; the judges here
compare it with what they compute (`verdicts.py`; in a lab of point-to-point messages, with what the grader's relay
carried).

How one failure is kept from spoiling the others:
- a check whose task raises, or whose judge finds a wrong answer, scores 0 with the message of the rank
  that failed first;
- each task talks over a fresh process group whose timeout is `check_timeout_s`; after a task the ranks
  wait for each other, and a rank whose task failed waits only a moment, then ends the launch;
- when a launch ends early (that way, a crash, an exit, a hang), the files show which check was running:
  it scores 0 with the launcher's story, and a new launch carries on after it;
- a deadlock (every rank blocked) or a file that cannot be imported stops the grading there.
A check that failed at a smaller world size is not run again at larger ones.
"""

from __future__ import annotations

import ast
import difflib
import secrets
import sys
import zlib
from dataclasses import replace
from pathlib import Path

import torch

from ..runtime import interrupts
from . import delegation, namespaces, sandbox, untrusted
from .box import Box
from .checks import PLATFORM_CHECKS, PLATFORM_ONLY, Check, platform_only
from .declared import declared
from .isolation import Sandbox
from .limits import Limits
from .runner import IMPORT, load_module
from .score import CheckResult, Score, format_score, zero
from .session import launch_ranks
from .verdicts import crash_story, first_failure, relayed, verdict

HIDDEN_CHECKS = "hidden_checks.py"  # the instructor's extra checks: graded, never released to students
HIDDEN_FAILED = "failed (a check graded on the course platform: its details are not shown)"

__all__ = ["CheckResult", "Limits", "Score", "format_score", "grade", "lab_checks"]


def lab_checks(lab_dir) -> tuple[list[Check], dict]:
    """(the checks of checks.py in the order it defines them, then hidden_checks.py's; the lab's ANSWERS)."""
    lab_dir = Path(lab_dir)
    module = load_module(lab_dir / "checks.py", f"_lab_checks_{zlib.crc32(str(lab_dir).encode())}")
    checks = [value for value in vars(module).values() if isinstance(value, Check)]
    if not checks:
        raise ValueError(f"{lab_dir}/checks.py defines no checks (functions decorated with @check).")
    if (lab_dir / HIDDEN_CHECKS).exists():  # it may `from checks import ...` the public helpers
        before = sys.modules.get("checks")
        sys.modules["checks"] = module
        try:
            hidden = load_module(lab_dir / HIDDEN_CHECKS, f"_lab_hidden_{zlib.crc32(str(lab_dir).encode())}")
        finally:
            if before is None:
                sys.modules.pop("checks", None)
            else:
                sys.modules["checks"] = before
        checks += [replace(v, hidden=True) for v in vars(hidden).values() if isinstance(v, Check) and v not in checks]
    elif (lab_dir / PLATFORM_CHECKS).exists():  # a students' copy: the hidden checks are named, not run
        checks += platform_only(lab_dir / PLATFORM_CHECKS)
    return checks, dict(getattr(module, "ANSWERS", {}))


def not_a_lab(folder: Path, missing: str) -> str:
    """Why `folder` is not a lab, and which labs are beside it (the one its name starts, first)."""
    what = "no such folder" if not folder.exists() else f"it has no {missing}"
    parent = folder.parent
    labs = sorted(p.name for p in parent.iterdir() if (p / "checks.py").is_file()) if parent.is_dir() else []
    message = f"{folder} is not a lab folder ({what})."
    matches = [name for name in labs if name.startswith(folder.name)] or difflib.get_close_matches(
        folder.name, labs, n=1, cutoff=0.5
    )
    if len(matches) == 1:
        message += f" Did you mean {parent / matches[0]}?"
    if labs:
        message += f" The labs in {parent}: {', '.join(labs)}."
    return message


def _generator(seed: int, check: Check, n: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed ^ zlib.crc32(f"{check.name}/{n}".encode())) % 2**63)


def _run_world_size(
    box: Box,
    checks: list[Check],
    indices: list[int],
    n: int,
    answers: dict,
    limits: Limits,
    seed: int,
    quiet: bool,
    backend: str,
    grading_id: str,
    messages_only: bool = False,
) -> tuple[dict, object]:
    """Run checks `indices` on n ranks: ({index: failure message, or ""}, what stopped the grading or None:
    the index of a check that deadlocked, or IMPORT when the file cannot be imported)."""
    inputs = {i: checks[i].make_inputs(n, _generator(seed, checks[i], n)) for i in indices}
    verdicts: dict = {}
    todo = list(indices)
    while todo:
        if not quiet:
            print(f"grading: {len(todo)} check(s) on {n} ranks ...", file=sys.stderr, flush=True)
        found = launch_ranks(
            box,
            n,
            todo,
            {i: checks[i].task for i in todo},
            inputs,
            list(answers),
            limits,
            backend=backend,
            quiet=quiet,
            grading_id=grading_id,
            messages_only=messages_only,
        )
        stuck = found.stuck
        imported = found.results[IMPORT]
        if not found.ready and not imported:  # no student code ran: the machine or the grader failed
            raise RuntimeError(
                f"the ranks could not be started on {n} processes: {crash_story(found)}\n"
                + "\n".join(found.lines[-20:])
            )
        failure = first_failure(imported)
        if stuck is not None and stuck["index"] == IMPORT:
            return {i: stuck["message"][:4000] for i in todo}, IMPORT
        if failure or len(imported) < n:
            message = failure[1] if failure else f"your file does not import: {crash_story(found)}"
            return {i: message for i in todo}, IMPORT
        if stuck is not None and stuck.get("stop") and stuck["index"] in todo:  # the next would deadlock too
            verdicts[stuck["index"]] = f"world size {n}, {stuck['message'][:4000]}"
            return verdicts, stuck["index"]
        for position, index in enumerate(todo):
            results = relayed(found.results.get(index, {}), found, index)
            verdicts[index] = verdict(checks[index], n, inputs[index], results, found)
            if stuck is not None and stuck["index"] == index:  # stopped in this check: carry on after it
                verdicts[index] = f"world size {n}, {stuck['message'][:4000]}"
                todo = todo[position + 1 :]
                break
            if len(results) < n or index == found.abandoned:  # the launch ended in this check
                todo = todo[position + 1 :]
                break
        else:
            todo = []
    return verdicts, None


def grade(
    lab_dir,
    solution_file=None,
    *,
    check_timeout_s: float | None = None,
    quiet: bool = True,
    backend: str = "gloo",
    limits: Limits | None = None,
    seed: int | None = None,
) -> Score:
    """Grade `solution_file` (default: the lab's skeleton.py) against every check of the lab in `lab_dir`.

    limits: what the solution may cost (`Limits()` by default); check_timeout_s overrides its
        `check_timeout_s`, how long one rank may wait for one message inside a check.
    quiet=False shows what the ranks print (a student's debugging output) while grading.
    backend: gloo by default, since the labs' tasks build CPU tensors, even on a machine with GPUs.
    seed: the inputs' seed (default: drawn afresh, so no submission can know the inputs in advance).
    Whatever the solution started is stopped before this returns. Raises `sandbox.Unsafe` (nothing run) where
    this machine cannot give the submission its sandbox: as root, with the interpreter out of the sandbox user's
    reach and no namespace to make it reachable.
    """
    limits = limits or Limits()
    if check_timeout_s is not None:
        limits = replace(limits, check_timeout_s=check_timeout_s)
    given, lab_dir = Path(lab_dir), Path(lab_dir).resolve()
    for needed in ("checks.py", "tasks.py"):
        if not (lab_dir / needed).exists():
            raise FileNotFoundError(not_a_lab(given, needed))
    solution = Path(solution_file).absolute() if solution_file else lab_dir / "skeleton.py"
    if not solution.exists() and not solution.is_symlink():
        raise FileNotFoundError(f"no solution file at {solution}.")
    try:  # the file itself, never what a link points to (a link to the lab's solution.py would score full marks)
        source = untrusted.read(solution, what="the solution file")
    except untrusted.Refused as exc:
        raise ValueError(str(exc)) from None
    solution = solution.parent.resolve() / solution.name
    checks, answers = lab_checks(lab_dir)
    user, made = sandbox.other_user(), namespaces.probe()
    sandbox.preflight(user, sandbox.python_paths(), made)  # never run a submission as root: refused, said why
    score = Score(lab=str(lab_dir), solution=str(solution), sandbox=sandbox.describe(made))
    try:  # the parser's own limits are the file's failure, not the grader's (an expression nested 100,000 deep)
        ast.parse(source, filename=solution.name)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        where = f" (line {exc.lineno})" if getattr(exc, "lineno", None) else ""
        what = (
            exc.msg
            if isinstance(exc, SyntaxError)
            else "Python's parser gave up on it (an expression nested too deeply)"
            if isinstance(exc, (RecursionError, MemoryError))
            else exc
        )
        return replace(
            zero(score.lab, score.solution, checks, f"your file does not import: {type(exc).__name__}: {what}{where}"),
            sandbox=score.sandbox,
        )
    uses = delegation.scan(source.decode(errors="replace"), answers)
    if uses:  # every check would score 0: nothing to run
        return replace(
            zero(score.lab, score.solution, checks, delegation.delegation_message(uses)), sandbox=score.sandbox
        )
    seed = secrets.randbits(62) if seed is None else seed
    verdicts, stopped = {}, None
    messages_only = bool(declared(lab_dir, "MESSAGES_ONLY", False))  # its ranks talk through the grader's relay
    # A Ctrl-C (a notebook's stop button) waits while the grading's processes and folders are made or stopped, so
    # that none is left with nobody to stop it (`runtime/interrupts.py`); while the grading runs, it acts at once.
    with (
        interrupts.held(),
        Sandbox() as marked,
        Box(lab_dir, source, solution.name, limits.disk_limit_mb) as box,
        interrupts.taken(),
    ):
        score.sandbox += f", {box.disk}"  # the instructor's report says whether the folders are capped in all
        if box.volume is None and not quiet:
            print(f"grading: {box.disk}", file=sys.stderr)
        for n in sorted({n for c in checks if not c.platform_only for n in c.world_sizes}):
            indices = [
                i for i, c in enumerate(checks) if n in c.world_sizes and not verdicts.get(i) and not c.platform_only
            ]
            if indices and stopped is None:
                found, stopped = _run_world_size(
                    box, checks, indices, n, answers, limits, seed, quiet, backend, marked.id, messages_only
                )
                verdicts.update(found)
    for i, c in enumerate(checks):
        if c.platform_only:
            score.results.append(CheckResult(c.name, c.points, 0, PLATFORM_ONLY, True, platform_only=True))
            continue
        message = verdicts.get(i, "")
        if stopped == IMPORT and i not in verdicts:
            message = next(m for m in verdicts.values() if m)
        elif stopped is not None and i not in verdicts:
            message = (
                f"not run: grading stopped at check '{checks[stopped].name}', which could not finish "
                "(see its message); fix that first."
            )
        shown = (c.feedback or HIDDEN_FAILED) if c.hidden and message else message
        score.results.append(
            CheckResult(c.name, c.points, 0 if message else c.points, shown, c.hidden, message if c.hidden else "")
        )
    return score
