"""`python -m toolkit release labs/ --out DIR`: the students' copy of the labs, without the solutions.

The instructor's tree holds, per lab, `README.md`, `skeleton.py`, `checks.py`, `solution.py` and
optionally `hidden_checks.py`. Students get the README, the skeleton and `checks.py` (so that
`python -m toolkit grade` works on their machine, with the same messages the course's grader gives),
plus `labs/README.md`, the syllabus. What stays with the instructor: every `solution*.py`, every
`hidden_checks.py` (checks graded on the course platform only), and `labs/autograder/` (the
platform's set-up, which grades with the full checks).

The release checks itself before it is written: no released file may import a solution
(`import solution`, `from solution import`, `load_module(".../solution.py")`, ...) or contain a line of
code that only the solution has (a line of solution.py that is in neither the skeleton nor the README).
A leak is an error that names the file and the line; nothing is written.
"""
from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

INSTRUCTOR_ONLY = ("solution*.py", "hidden_checks.py", "__pycache__", "*.pyc")
INSTRUCTOR_FOLDERS = ("autograder",)
IMPORTS_A_SOLUTION = re.compile(r"(^|\W)(import|from)\s+[\w.]*solution\b|solution\.py|['\"]solution['\"]")
MIN_LINE = 24  # shorter lines (`return out`, `for step in range(n - 1):`) are common to any code


def labs_in(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and (p / "checks.py").exists())


def solution_only_lines(lab: Path) -> set[str]:
    """Lines of code only the solution has: the answer a student must not be handed."""
    given = set()
    for name in ("skeleton.py", "README.md"):
        if (lab / name).exists():
            given |= {line.strip() for line in (lab / name).read_text().splitlines()}
    found = set()
    for solution in lab.glob("solution*.py"):
        for line in solution.read_text().splitlines():
            text = line.strip()
            if len(text) >= MIN_LINE and not text.startswith(("#", '"""', "'''", "import ", "from ")) \
                    and text not in given:
                found.add(text)
    return found


def leaks(files: dict[Path, str], secrets: set[str]) -> list[str]:
    """Every import of a solution and every solution-only line among `files` ({path: text})."""
    problems = []
    for path, text in files.items():
        for number, line in enumerate(text.splitlines(), 1):
            stripped = line.strip()
            if path.suffix == ".py" and IMPORTS_A_SOLUTION.search(line) and not stripped.startswith("#"):
                problems.append(f"{path} line {number} refers to a solution: {stripped}")
            elif stripped in secrets:
                problems.append(f"{path} line {number} is a line of the solution: {stripped}")
    return problems


def release(labs_root, out) -> list[Path]:
    """Write the students' copy of `labs_root` into `out` (which must not exist yet); return its files."""
    labs_root, out = Path(labs_root).resolve(), Path(out).resolve()
    labs = labs_in(labs_root) if labs_root.is_dir() else []
    if not labs:
        raise FileNotFoundError(f"{labs_root} holds no labs (folders with a checks.py).")
    if out.exists():
        raise FileExistsError(f"{out} exists already; give a new folder, so nothing old is mixed in.")
    if out == labs_root or labs_root in out.parents:
        raise ValueError(f"--out {out} is inside {labs_root}: put the release outside the instructor's tree.")
    plan: dict[Path, Path] = {}  # source -> destination
    if (labs_root / "README.md").exists():
        plan[labs_root / "README.md"] = out / "README.md"
    for lab in labs:
        if lab.name in INSTRUCTOR_FOLDERS:
            continue
        for source in sorted(lab.rglob("*")):
            relative = source.relative_to(lab)
            if source.is_file() and not any(relative.match(p) or part == p for p in INSTRUCTOR_ONLY
                                            for part in relative.parts):
                plan[source] = out / lab.name / relative
    problems = []
    for lab in labs:  # a lab's files against its own solution (another lab's may share a line honestly)
        problems += leaks({dest: src.read_text() for src, dest in plan.items() if lab in src.parents},
                          solution_only_lines(lab))
    problems += leaks({dest: src.read_text() for src, dest in plan.items() if src.parent == labs_root}, set())
    if problems:
        raise ValueError("the release would give away solutions; nothing was written:\n  " + "\n  ".join(problems))
    for source, dest in plan.items():
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, dest)
    return sorted(plan.values())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolkit release",
                                     description="Copy the labs for students: skeletons, READMEs and checks, "
                                                 "without solutions or hidden checks.")
    parser.add_argument("labs", help="the instructor's labs folder, e.g. labs/")
    parser.add_argument("--out", required=True, help="a new folder for the students' copy")
    args = parser.parse_args(argv)
    try:
        files = release(args.labs, args.out)
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    labs = sorted({f.parent.name for f in files if f.name == "checks.py"})
    print(f"released {len(labs)} labs ({len(files)} files) to {args.out}: no solutions, no hidden checks.")
    return 0
