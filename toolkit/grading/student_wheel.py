"""The toolkit as students install it: a wheel in which every released lab's answer is taken out.

Each lab's `checks.py` names its answers (`ANSWERS`: `toolkit.comm.ring` for lab 01, `toolkit.sim.timeline:
schedule` for lab 10, ...). `build` copies the toolkit's source, replaces the body of every answer function
and method by `raise NotImplementedError(<why, and what to do>)` (its signature and docstring stay, so
`import toolkit` and the rest of the package work), checks that no answer's code is left, and builds a
wheel with pip (`distributed_training_toolkit-<version>+student`). What stops working is exactly what the labs ask students to
write: a lesson cell that runs the toolkit's ring, say, says so when run. labs/README.md tells a course
which lessons lean on which answers.
"""
from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROJECT_FILES = ("pyproject.toml", "README.md")
PROJECT_FOLDERS = ("toolkit", "toolkit_lessons", "jupyter-config")
MESSAGE = ("{name} is not in the students' toolkit: it is the answer to a lab of this course (labs/README.md). "
           "Write your own in the lab's skeleton.py; the lab's README says how to plug it in.")


def _wanted(qualname: str, names) -> bool:
    return names is None or any(qualname == n or qualname.startswith(n + ".") for n in names)


def _targets(tree, names):
    """Every function or method (by qualified name) the answer covers; names None: all of them."""
    found = []

    def visit(body, prefix):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _wanted(prefix + node.name, names):
                found.append((prefix + node.name, node))
            elif isinstance(node, ast.ClassDef):
                visit(node.body, prefix + node.name + ".")

    visit(tree.body, "")
    return found


def stub(text: str, names, module: str) -> tuple[str, list[str]]:
    """`text` with the bodies of the functions `names` (qualified names; None: every one) replaced by a raise;
    and the qualified names it replaced."""
    tree = ast.parse(text)
    lines = text.splitlines()
    targets = _targets(tree, names)
    for qualname, node in sorted(targets, key=lambda t: -t[1].lineno):
        body = node.body
        keep = 1 if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None),
                                                                              ast.Constant) else 0
        if body[0].lineno == node.lineno:
            raise ValueError(f"{module}.{qualname}: a one-line function cannot be taken out; write its body on lines "
                             "of its own")
        indent = " " * body[0].col_offset
        start = body[keep].lineno if keep < len(body) else body[-1].end_lineno + 1
        raise_line = f"{indent}raise NotImplementedError({MESSAGE.format(name=f'{module}.{qualname}')!r})"
        lines[start - 1:node.end_lineno] = [raise_line]
    return "\n".join(lines) + "\n", [q for q, _ in targets]


def _module_file(source: Path, module: str) -> Path:
    path = source.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def take_out(source: Path, answers) -> list[str]:
    """Replace every toolkit answer of `answers` (specs, as labs' ANSWERS name them) in the copy at `source`;
    return what was taken out. A package answer takes out every module in it."""
    taken = []
    for spec in sorted(s for s in answers if s.startswith("toolkit.")):
        module, _, name = spec.partition(":")
        path = _module_file(source, module)
        if not path.exists():
            raise ValueError(f"the answer {spec} names no module of the toolkit ({path} is missing)")
        files = sorted(path.parent.rglob("*.py")) if path.name == "__init__.py" and not name else [path]
        for file in files:
            dotted = ".".join(file.relative_to(source).with_suffix("").parts).removesuffix(".__init__")
            text, replaced = stub(file.read_text(), [name] if name else None, dotted)
            if name and not replaced:
                raise ValueError(f"the answer {spec}: {dotted} defines no {name}")
            file.write_text(text)
            taken += [f"{dotted}.{q}" for q in replaced]
    return taken


def _left(source: Path, taken: list[str]) -> list[str]:
    """Answers whose body is more than the raise (a stub that did not take)."""
    problems = []
    for full in taken:
        parts = full.split(".")
        for k in range(len(parts) - 1, 0, -1):
            path = _module_file(source, ".".join(parts[:k]))
            if path.exists():
                names = ".".join(parts[k:])
                for qualname, node in _targets(ast.parse(path.read_text()), [names]):
                    body = [n for n in node.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
                    if qualname == names and (len(body) != 1 or not isinstance(body[0], ast.Raise)):
                        problems.append(full)
                break
    return problems


def strip(source: Path, answers, builds_on) -> tuple[list[str], list[str]]:
    """Take `answers` but `builds_on` out of the toolkit copied at `source` (a folder holding toolkit/), checked:
    what `build` packs, and what a grading's ranks import (`students_build.py`). Returns (taken, kept)."""
    kept = sorted(set(answers) & set(builds_on))
    taken = take_out(source, set(answers) - set(builds_on))
    left = _left(source, taken)
    if left:
        raise RuntimeError(f"these answers could not be taken out: {left}")
    return taken, kept


def build(answers, builds_on, out: Path) -> Path:
    """Build the students' wheel into `out` from the toolkit's source, without `answers` but for those another
    released lab runs on (`builds_on`: lab 07's units inherit lab 03's unshard); return the wheel's path."""
    import toolkit

    project = Path(toolkit.__file__).resolve().parent.parent
    if not (project / "pyproject.toml").exists():
        raise RuntimeError(f"the toolkit at {project} is installed, not a source checkout: build the students' wheel "
                           "from the course's repository.")
    with tempfile.TemporaryDirectory(prefix="toolkit-student-") as tmp:
        source = Path(tmp) / "source"
        source.mkdir()
        for name in PROJECT_FILES:
            shutil.copy2(project / name, source / name)
        for name in PROJECT_FOLDERS:
            if (project / name).exists():
                shutil.copytree(project / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        taken, kept = strip(source, answers, builds_on)
        pyproject = source / "pyproject.toml"
        pyproject.write_text(re.sub(r'^version = "([^"+]+)"', r'version = "\1+student"', pyproject.read_text(),
                                    count=1, flags=re.M))
        out.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                               "-w", str(out), str(source)], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"pip could not build the students' wheel:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    wheels = sorted(out.glob("distributed_training_toolkit-*+student-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip built no wheel in {out}")
    (out / "LEFT-OUT.txt").write_text(
        "Taken out of this toolkit (the labs' answers):\n" + "\n".join(taken) + "\n\nKept, though a lab's answer, "
        "because another released lab runs on it (release that lab later to take it out too):\n"
        + ("\n".join(kept) or "(none)") + "\n")
    return wheels[-1]
