"""The toolkit as students get it: every released lab's answer taken out, as a wheel or as a source tree.

Each lab's `checks.py` names its answers (`ANSWERS`: `toolkit.comm.ring` for lab 01, `toolkit.sim.timeline:
schedule` for lab 10, ...), the toolkit's own implementation of what the lab teaches and every function that
equals or nearly equals it under another name (labs/README.md, "What the students' toolkit leaves out").
`students_toolkit` copies the toolkit's source and replaces every answer function and method, docstring
included, by `raise NotImplementedError(<why, and what to do>)` (its signature stays, so `import toolkit` and
the rest of the package work; a module that is an answer as a whole loses its docstring too), follows a name a
module only re-exports to the module that defines it, and checks that no answer's code or docstring is left.
The tree is cached by content (the toolkit's files, the answers, this file), so a grading that imports it on
its ranks (`for_lab`) builds it once. `build` makes a wheel of it with pip
(`distributed_training_toolkit-<version>+student`). What
stops working is exactly what the labs ask students to write: a lesson cell that runs the toolkit's ring, say,
says so when run. labs/README.md tells a course which lessons lean on which answers.
"""

from __future__ import annotations

import ast
import compileall
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROJECT_FILES = ("pyproject.toml", "README.md")
PROJECT_FOLDERS = ("toolkit", "toolkit_lessons", "jupyter-config")
MESSAGE = (
    "{name} is not in the students' toolkit: it is the answer to a lab of this course (labs/README.md). "
    "Write your own in the lab's skeleton.py; the lab's README says how to plug it in."
)
MODULE_DOC = '"""{name}: not in the students\' toolkit, it is the answer to a lab of this course (labs/README.md)."""'
CACHE = Path(os.environ.get("TOOLKIT_STUDENT_CACHE", Path.home() / ".cache" / "toolkit" / "students"))


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


def _docstring(node):
    body = getattr(node, "body", [])
    return (
        body[0]
        if body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
        else None
    )


def stub(text: str, names, module: str) -> tuple[str, list[str]]:
    """`text` with the functions `names` (qualified names; None: every one, and the module's docstring) reduced to a
    raise, their docstrings gone; and the qualified names it replaced."""
    tree = ast.parse(text)
    lines = text.splitlines()
    targets = _targets(tree, names)
    for qualname, node in sorted(targets, key=lambda t: -t[1].lineno):
        body = node.body
        if body[0].lineno == node.lineno:
            raise ValueError(
                f"{module}.{qualname}: a one-line function cannot be taken out; write its body on lines of its own"
            )
        indent = " " * body[0].col_offset
        raise_line = f"{indent}raise NotImplementedError({MESSAGE.format(name=f'{module}.{qualname}')!r})"
        lines[body[0].lineno - 1 : node.end_lineno] = [raise_line]
    doc = _docstring(tree)
    if names is None and doc is not None:  # a module that is an answer as a whole: its account of it goes too
        lines[doc.lineno - 1 : doc.end_lineno] = [MODULE_DOC.format(name=module)]
    return "\n".join(lines) + "\n", [q for q, _ in targets]


def _module_file(source: Path, module: str) -> Path:
    path = source.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _defined_in(source: Path, module: str, name: str) -> str:
    """The module that defines `name`, following `from .x import name` re-exports (`toolkit.moe.layer:all_to_all`
    is `toolkit.moe.exchange`'s)."""
    path = _module_file(source, module)
    tree = ast.parse(path.read_text())
    top = name.split(".")[0]
    if any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == top for n in tree.body):
        return module
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any(a.name == top and a.asname in (None, top) for a in node.names):
            package = module.split(".")[: len(module.split(".")) - node.level + (path.name == "__init__.py")]
            origin = ".".join(package + ([node.module] if node.module else [])) if node.level else node.module
            if origin and origin.startswith("toolkit.") and _module_file(source, origin).exists():
                return _defined_in(source, origin, name)
    return module


def take_out(source: Path, answers) -> list[str]:
    """Replace every toolkit answer of `answers` (specs, as labs' ANSWERS name them) in the copy at `source`;
    return what was taken out. A package answer takes out every module in it."""
    taken = []
    for spec in sorted(s for s in answers if s.startswith("toolkit.")):
        module, _, name = spec.partition(":")
        path = _module_file(source, module)
        if not path.exists():
            raise ValueError(f"the answer {spec} names no module of the toolkit ({path} is missing)")
        if name:
            path = _module_file(source, _defined_in(source, module, name))
        files = sorted(path.parent.rglob("*.py")) if path.name == "__init__.py" and not name else [path]
        for file in files:
            dotted = ".".join(file.relative_to(source).with_suffix("").parts).removesuffix(".__init__")
            text, replaced = stub(file.read_text(), [name] if name else None, dotted)
            if name and not replaced:
                raise ValueError(f"the answer {spec}: {dotted} defines no {name}")
            file.write_text(text)
            taken += [f"{dotted}.{q}" for q in replaced]
    return sorted(set(taken))


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
                    if qualname == names and (len(node.body) != 1 or not isinstance(node.body[0], ast.Raise)):
                        problems.append(full)  # code or a docstring left beside the raise
                break
    return problems


def _fingerprint(project: Path, answers, builds_on) -> str:
    """What the tree depends on: the toolkit's files, the answers taken out and kept, and this file's code."""
    digest = hashlib.sha256(repr((sorted(answers), sorted(builds_on))).encode())
    digest.update(Path(__file__).read_bytes())
    for path in sorted((project / "toolkit").rglob("*.py")):
        if "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(project)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:24]


def _project() -> Path:
    import toolkit

    project = Path(toolkit.__file__).resolve().parent.parent
    if not (project / "pyproject.toml").exists():
        raise RuntimeError(
            f"the toolkit at {project} is installed, not a source checkout: build the students' toolkit "
            "from the course's repository."
        )
    return project


def _package_root() -> Path:
    """The folder holding the toolkit package that runs here: a checkout, or where it is installed (a student
    grading with the students' wheel installed, a course's image)."""
    import toolkit

    return Path(toolkit.__file__).resolve().parent.parent


def students_toolkit(answers, builds_on=()) -> Path:
    """A folder holding `toolkit/` with `answers` taken out but for those another lab runs on (`builds_on`): put it
    first on a process's path (PYTHONPATH) and `import toolkit` is the students' toolkit. Built once per content
    (cached under TOOLKIT_STUDENT_CACHE, default ~/.cache/toolkit/students), readable by every user; `LEFT-OUT.txt`
    beside it says what was taken out and what kept."""
    project = _package_root()
    root = CACHE / _fingerprint(project, answers, builds_on)
    if (root / "LEFT-OUT.txt").exists():
        return root
    CACHE.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=root.name + ".", dir=CACHE))
    try:
        shutil.copytree(
            project / "toolkit", building / "toolkit", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
        kept = sorted(set(answers) & set(builds_on))
        taken = take_out(building, set(answers) - set(builds_on))
        left = _left(building, taken)
        if left:
            raise RuntimeError(f"these answers could not be taken out: {left}")
        (building / "LEFT-OUT.txt").write_text(
            "Taken out of this toolkit (the labs' answers):\n" + "\n".join(taken) + "\n\nKept, though a lab's answer, "
            "because another released lab runs on it (release that lab later to take it out too):\n"
            + ("\n".join(kept) or "(none)")
            + "\n"
        )
        compileall.compile_dir(building / "toolkit", quiet=2, workers=1)  # ranks that cannot write import fast
        for folder, _, files in os.walk(building):
            os.chmod(folder, 0o755)
            for name in files:
                os.chmod(os.path.join(folder, name), 0o644)
        try:
            os.rename(building, root)  # whole or not at all: a concurrent build of the same content loses the race
        except OSError:
            if not (root / "LEFT-OUT.txt").exists():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return root


def for_lab(lab_dir) -> Path:
    """The students' toolkit a grading of `lab_dir` imports on its ranks: the lab's answers taken out, the other
    labs' answers it runs on (its BUILDS_ON) kept."""
    from .declared import declared

    lab_dir = Path(lab_dir)
    return students_toolkit(set(declared(lab_dir, "ANSWERS", {})), set(declared(lab_dir, "BUILDS_ON", [])))


def build(answers, builds_on, out: Path) -> Path:
    """Build the students' wheel into `out` from the toolkit's source, without `answers` but for those another
    released lab runs on (`builds_on`: lab 07's units inherit lab 03's unshard); return the wheel's path."""
    project = _project()
    tree = students_toolkit(answers, builds_on)
    with tempfile.TemporaryDirectory(prefix="toolkit-student-") as tmp:
        source = Path(tmp) / "source"
        source.mkdir()
        for name in PROJECT_FILES:
            shutil.copy2(project / name, source / name)
        shutil.copytree(tree / "toolkit", source / "toolkit")
        for name in PROJECT_FOLDERS:
            if name != "toolkit" and (project / name).exists():
                shutil.copytree(project / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        pyproject = source / "pyproject.toml"
        pyproject.write_text(
            re.sub(r'^version = "([^"+]+)"', r'version = "\1+student"', pyproject.read_text(), count=1, flags=re.M)
        )
        out.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "--no-build-isolation",
                "-q",
                "-w",
                str(out),
                str(source),
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode != 0:
            raise RuntimeError(f"pip could not build the students' wheel:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    wheels = sorted(out.glob("distributed_training_toolkit-*+student-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip built no wheel in {out}")
    shutil.copy(tree / "LEFT-OUT.txt", out / "LEFT-OUT.txt")
    return wheels[-1]
