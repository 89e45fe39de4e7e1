"""`python -m toolkit release labs/ --out DIR [--wheel]`: the students' copy of the labs, without the answers.

The instructor's tree holds, per lab, `README.md`, `skeleton.py`, `tasks.py`, `checks.py`, `solution.py`,
optionally `hidden_checks.py`, and whatever the lab's `checks.py` names in `INSTRUCTOR_ONLY` (lab 10's
`record_steps.py`, which computes the answers). Students get the README, the skeleton, the tasks and the
checks (so that `python -m toolkit grade` works on their machine, with the same messages the course's grader
gives), the lab's data, `platform_checks.json` naming the hidden checks (their names and points: the local
grading lists them as run on the course platform only), and `labs/README.md`. What stays with the instructor: every `solution*.py`, every
`hidden_checks.py` (graded on the course platform only), the `INSTRUCTOR_ONLY` files, `labs/autograder/`, and
every README passage between `<!-- instructor -->` and `<!-- /instructor -->`.

Nothing is written unless every check passes:
- no skeleton is solved: where the labs are in git, each skeleton.py is the committed one; and each still
  leaves a function to write (a body that raises NotImplementedError);
- no released file imports a solution, holds a line of code only a solution has (a line of solution.py in
  neither the committed skeleton nor the README), or names one of its lab's `ANSWERS` (the toolkit's own
  implementation of what the lab teaches: `delegation.py`);
- no released README links to a file the release does not hold.
`--wheel` also builds the toolkit for the students, with every released lab's answers taken out
(`student_wheel.py`).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from . import delegation
from .checks import PLATFORM_CHECKS
from .declared import declared
from .grader import lab_checks

INSTRUCTOR_ONLY = ("solution*.py", "hidden_checks.py", "equivalent_mutants.md", "__pycache__", "*.pyc")
INSTRUCTOR_FOLDERS = ("autograder",)
IMPORTS_A_SOLUTION = re.compile(r"(^|\W)(import|from)\s+[\w.]*solution\b|solution\.py|['\"]solution['\"]")
INSTRUCTOR_TEXT = re.compile(r"^<!-- instructor -->$.*?^<!-- /instructor -->$\n?", re.S | re.M)  # lines of their own
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")
MIN_LINE = 24  # shorter lines (`return out`, `for step in range(n - 1):`) are common to any code


def labs_in(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and (p / "checks.py").exists())


def committed(path: Path) -> str | None:
    """The file as the repository's HEAD holds it; None outside git (or not committed)."""
    try:
        done = subprocess.run(
            ["git", "show", f"HEAD:./{path.name}"], cwd=path.parent, capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _raises_not_implemented(fn) -> bool:
    return any(isinstance(n, ast.Raise) and "NotImplementedError" in ast.unparse(n) for n in ast.walk(fn))


def solved(lab: Path) -> str:
    """Why the lab's skeleton.py is not the students' starting point ("" when it is)."""
    text = (lab / "skeleton.py").read_text()
    head = committed(lab / "skeleton.py")
    if head is not None and head != text:
        changed = [i + 1 for i, (a, b) in enumerate(zip(head.splitlines(), text.splitlines())) if a != b]
        return (
            f"{lab.name}/skeleton.py differs from the committed one (line {changed[0] if changed else 'count'}): a "
            "skeleton filled in place? Restore it (git checkout -- skeleton.py) or commit the one to release."
        )
    functions = [n for n in ast.walk(ast.parse(text)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if not any(map(_raises_not_implemented, functions)):
        return (
            f"{lab.name}/skeleton.py leaves nothing to write: no function raises NotImplementedError (a "
            "solved skeleton?)"
        )
    return ""


def solution_only_lines(lab: Path) -> set[str]:
    """Lines of code only the solution has: the answer a student must not be handed."""
    given = set()
    for name in ("skeleton.py", "README.md"):
        if (lab / name).exists():
            text = committed(lab / name) if name == "skeleton.py" else None
            given |= {line.strip() for line in (text or (lab / name).read_text()).splitlines()}
    found = set()
    for solution in lab.glob("solution*.py"):
        for line in solution.read_text().splitlines():
            text = line.strip()
            if (
                len(text) >= MIN_LINE
                and not text.startswith(("#", '"""', "'''", "import ", "from "))
                and text not in given
            ):
                found.add(text)
    return found


def leaks(files: dict[Path, str], secrets: set[str], answers: dict = None) -> list[str]:
    """Every import of a solution, solution-only line and use of the lab's answers among `files` ({path: text})."""
    problems = []
    for path, text in files.items():
        if path.suffix == ".py" and answers:
            problems += [
                f"{path} names {use}: the released checks and tasks may not use the answer"
                for use in delegation.scan(_without_declarations(text), answers)
            ]
        for number, line in enumerate(text.splitlines(), 1):
            stripped = line.strip()
            if path.suffix == ".py" and IMPORTS_A_SOLUTION.search(line) and not stripped.startswith("#"):
                problems.append(f"{path} line {number} refers to a solution: {stripped}")
            elif stripped in secrets:
                problems.append(f"{path} line {number} is a line of the solution: {stripped}")
    return problems


def _without_declarations(text: str) -> str:
    """A checks.py without its ANSWERS (the names it declares are not uses of them)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    tree.body = [
        n
        for n in tree.body
        if not (isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "ANSWERS" for t in n.targets))
    ]
    return ast.unparse(tree)


def dead_links(texts: dict[Path, str], released: set[Path]) -> list[str]:
    problems = []
    for path, text in texts.items():
        for target, _ in LINK.findall(text):
            if "://" not in target and (path.parent / target).resolve() not in released:
                problems.append(f"{path} links to {target}, which the release does not hold")
    return problems


def plan_of(labs_root: Path, labs: list[Path], out: Path) -> dict[Path, Path]:
    """source -> destination of every released file."""
    plan = {labs_root / "README.md": out / "README.md"} if (labs_root / "README.md").exists() else {}
    for lab in labs:
        if lab.name in INSTRUCTOR_FOLDERS:
            continue
        private = INSTRUCTOR_ONLY + tuple(declared(lab, "INSTRUCTOR_ONLY", []))
        for source in sorted(lab.rglob("*")):
            relative = source.relative_to(lab)
            if source.is_file() and not any(relative.match(p) or part == p for p in private for part in relative.parts):
                plan[source] = out / lab.name / relative
    return plan


def chosen(labs_root: Path, names=None) -> list[Path]:
    """The labs of `labs_root` to release: all of them, or those named (folder names)."""
    labs = labs_in(labs_root) if labs_root.is_dir() else []
    if not labs:
        raise FileNotFoundError(f"{labs_root} holds no labs (folders with a checks.py).")
    if names:
        unknown = sorted(set(names) - {lab.name for lab in labs})
        if unknown:
            raise ValueError(f"no lab named {unknown} in {labs_root}; the labs are {[lab.name for lab in labs]}")
        labs = [lab for lab in labs if lab.name in names]
    return labs


def release(labs_root, out, names=None) -> list[Path]:
    """Write the students' copy of `labs_root` (the labs `names`, default all) into `out` (which must not exist
    yet); return its files."""
    labs_root, out = Path(labs_root).resolve(), Path(out).resolve()
    labs = chosen(labs_root, names)
    if out.exists():
        raise FileExistsError(f"{out} exists already; give a new folder, so nothing old is mixed in.")
    if out == labs_root or labs_root in out.parents:
        raise ValueError(f"--out {out} is inside {labs_root}: put the release outside the instructor's tree.")
    plan = plan_of(labs_root, labs, out)
    texts = {
        dest: INSTRUCTOR_TEXT.sub("", src.read_text()) if src.suffix == ".md" else src.read_text()
        for src, dest in plan.items()
    }
    later = [lab.name for lab in labs_in(labs_root) if lab not in labs]
    if later and out / "README.md" in texts:  # the syllabus names the labs still to come, without a link
        texts[out / "README.md"] = re.sub(
            r"\[([^\]]+)\]\((%s)/[^)]*\)" % "|".join(map(re.escape, later)),
            r"\1 (released later)",
            texts[out / "README.md"],
        )
    problems = [why for lab in labs if (why := solved(lab))]
    for lab in labs:  # a lab's files against its own solution (another lab's may share a line honestly)
        problems += leaks(
            {dest: texts[dest] for src, dest in plan.items() if lab in src.parents},
            solution_only_lines(lab),
            declared(lab, "ANSWERS", {}),
        )
    problems += leaks({dest: texts[dest] for src, dest in plan.items() if src.parent == labs_root}, set())
    for lab in labs:  # the hidden checks, named (the local grading says they run on the platform only)
        hidden = [c for c in lab_checks(lab)[0] if c.hidden] if (lab / "hidden_checks.py").exists() else []
        if hidden:
            texts[out / lab.name / PLATFORM_CHECKS] = json.dumps(
                [{"name": c.name, "points": c.points, "world_sizes": list(c.world_sizes)} for c in hidden], indent=1
            )
    problems += dead_links(
        {d: t for d, t in texts.items() if d.suffix == ".md"},
        {d.resolve() for d in plan.values()} | {(out / lab.name).resolve() for lab in labs},
    )
    if problems:
        raise ValueError(
            "the release would give away answers or mislead students; nothing was written:\n  " + "\n  ".join(problems)
        )
    for source, dest in plan.items():
        dest.parent.mkdir(parents=True, exist_ok=True)
        if source.suffix in (".md", ".py"):
            dest.write_text(texts[dest])
        else:
            shutil.copy2(source, dest)
    written = {dest for dest in texts if dest.name == PLATFORM_CHECKS}
    for dest in written:
        dest.write_text(texts[dest] + "\n")
    return sorted(set(plan.values()) | written)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m toolkit release",
        description="Copy the labs for students: skeletons, READMEs, tasks and checks, "
        "without solutions, hidden checks or instructors' notes.",
    )
    parser.add_argument("labs", help="the instructor's labs folder, e.g. labs/")
    parser.add_argument("--out", required=True, help="a new folder for the students' copy")
    parser.add_argument("--labs", dest="labs_", nargs="+", metavar="LAB", help="release only these labs (folder names)")
    parser.add_argument(
        "--wheel",
        action="store_true",
        help="also build the toolkit for students into OUT/wheel, without the released labs' answers",
    )
    args = parser.parse_args(argv)
    try:
        files = release(args.labs, args.out, args.labs_)
        wheel = None
        if args.wheel:
            from .student_wheel import build

            labs = chosen(Path(args.labs).resolve(), args.labs_)
            wheel = build(
                {s for lab in labs for s in declared(lab, "ANSWERS", {})},
                {s for lab in labs for s in declared(lab, "BUILDS_ON", [])},
                Path(args.out) / "wheel",
            )
    except (FileNotFoundError, FileExistsError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    labs = sorted({f.parent.name for f in files if f.name == "checks.py"})
    print(f"released {len(labs)} labs ({len(files)} files) to {args.out}: no solutions, no hidden checks.")
    if wheel is not None:
        print(f"the toolkit for students, without the labs' answers: {wheel}")
    return 0
