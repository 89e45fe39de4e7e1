"""Every lesson cell survives being run again, and out of order, once the set-up cells have run.

A student re-runs a cell to see a number move, or jumps back to an earlier figure. That breaks when a
cell rebinds a name that another cell reads: lesson 02's bucket sweep once looped
`for cap, calls, step_time, overlap, sent in rows:`, turning the `step_time` function into a float, so
re-running the sweep (or the overlap table above it) raised "'float' object is not callable".

The check is static (no kernel, well under a second): for each cell, in statement order, the names it
reads before binding them itself are its inputs, which come from other cells. An input must be bound
by exactly one cell of the lesson, and a cell must not grow an input in place (`x += ...`,
`x.append(...)`), which would double on a second run. (`x[k] = ...` is left alone: doing it twice is
doing it once.) Names a cell binds before reading
them (scratch such as `fig`, a loop variable) are its own and may be reused by any cell.
"""

import ast
import glob
import os

import jupytext
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LESSONS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.py")))
MUTATORS = {"append", "extend", "insert", "pop", "remove", "popitem"}  # a second call changes the result again


def _stores(node) -> set:
    """Names a target (or a whole subtree) binds."""
    names = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            names.add(n.id)
        elif isinstance(n, ast.arg):
            names.add(n.arg)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in n.names)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            names.add(n.name)
    return names


def _loads(node) -> set:
    """Names an expression (or a def's body, read when called) takes from the module, less its own locals."""
    loaded = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    scoped = [
        n
        for n in ast.walk(node)
        if isinstance(n, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef, ast.comprehension))
    ]
    local = set()
    for n in scoped:
        local |= _stores(n.target if isinstance(n, ast.comprehension) else n.args)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            local |= {s for stmt in n.body for s in _stores(stmt)}
    return loaded - local


SCOPES = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.Lambda)


def _module_stores(node) -> set:
    """Names an expression statement binds in the module: `:=` and the like, not a comprehension's own
    variables (Python 3 keeps those inside the comprehension)."""
    if isinstance(node, SCOPES):
        return set()
    names = {node.id} if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) else set()
    for child in ast.iter_child_nodes(node):
        names |= _module_stores(child)
    return names


class Cell:
    """What one cell binds at module level, which names it takes from other cells, and which it edits."""

    def __init__(self, source: str):
        self.binds, self.inputs, self.edits = set(), set(), set()
        self._block(ast.parse(source).body)

    def _read(self, node):
        outside = _loads(node) - self.binds
        self.inputs |= outside
        for n in ast.walk(node):  # x.append(...) on a name from another cell
            if (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr in MUTATORS
                and isinstance(n.func.value, ast.Name)
                and n.func.value.id in outside
            ):
                self.edits.add(n.func.value.id)

    def _bind(self, target):
        self.binds |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}

    def _block(self, statements):
        for s in statements:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                for d in s.decorator_list:
                    self._read(d)
                self._read(s)
                self.binds.add(s.name)
            elif isinstance(s, (ast.Import, ast.ImportFrom)):
                self.binds |= _stores(s)
            elif isinstance(s, ast.Assign):
                self._read(s.value)
                for t in s.targets:
                    self._bind(t)
            elif isinstance(s, ast.AnnAssign):
                if s.value is not None:
                    self._read(s.value)
                self._bind(s.target)
            elif isinstance(s, ast.AugAssign):  # x += ..., x[k] += ...: reads x, then grows it
                self._read(s.value)
                base = s.target
                while isinstance(base, (ast.Subscript, ast.Attribute)):
                    base = base.value
                if isinstance(base, ast.Name) and base.id not in self.binds:
                    self.edits.add(base.id)
                self._bind(s.target)
            elif isinstance(s, (ast.For, ast.AsyncFor)):
                self._read(s.iter)
                self._bind(s.target)
                self._block(s.body + s.orelse)
            elif isinstance(s, (ast.With, ast.AsyncWith)):
                for item in s.items:
                    self._read(item.context_expr)
                    if item.optional_vars is not None:
                        self._bind(item.optional_vars)
                self._block(s.body)
            elif isinstance(s, (ast.If, ast.While)):
                self._read(s.test)
                self._block(s.body + s.orelse)
            elif isinstance(s, ast.Try):
                self._block(s.body)
                for h in s.handlers:
                    if h.type is not None:
                        self._read(h.type)
                    if h.name:
                        self.binds.add(h.name)
                    self._block(h.body)
                self._block(s.orelse + s.finalbody)
            else:  # expressions, return, assert, raise, del, ...
                self._read(s)
                self.binds |= _module_stores(s)


def code_cells(path):
    """(index, source) of each code cell, IPython magics and shell lines left out."""
    cells = []
    for i, cell in enumerate(jupytext.read(path).cells):
        if cell.cell_type == "code":
            lines = [line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!"))]
            cells.append((i, "\n".join(lines)))
    return cells


def rerun_hazards(path) -> list[str]:
    """Why some cell of the lesson would break, or change another's result, when run again or out of order."""
    cells = [(i, Cell(source)) for i, source in code_cells(path)]
    binders = {}
    for i, cell in cells:
        for name in cell.binds:
            binders.setdefault(name, []).append(i)
    problems = []
    for i, cell in cells:
        for name in sorted(cell.inputs):
            if len(binders.get(name, ())) > 1:
                problems.append(
                    f"cell {i} reads {name!r}, which cells {binders[name]} all bind: whichever ran "
                    "last decides what it gets"
                )
        for name in sorted(cell.edits & set(binders)):
            problems.append(
                f"cell {i} changes {name!r} from cell {binders[name][0]} in place: a second run changes it again"
            )
    return problems


def test_the_checker_catches_the_bucket_sweep_bug(tmp_path):
    lesson = tmp_path / "lesson.py"
    lesson.write_text(
        "# %%\ndef step_time(run):\n    return run\n\n"
        "# %%\nprint(step_time(1))\n\n"
        "# %%\nrows = [(1, 2.0)]\nfor cap, step_time in rows:\n    print(step_time)\n\n"
        "# %%\ntotal = 0\n\n# %%\ntotal += 1\nseen = []\n\n# %%\nseen.append(1)\n"
    )
    problems = rerun_hazards(lesson)
    assert any("cell 1 reads 'step_time'" in p for p in problems), problems
    assert any("'total'" in p and "in place" in p for p in problems), problems
    assert any("'seen'" in p and "in place" in p for p in problems), problems
    lesson.write_text(
        "# %%\ndef step_time(run):\n    return run\n\n# %%\nprint(step_time(1))\n\n"
        "# %%\nfor cap, seconds in [(1, 2.0)]:\n    fig = seconds\nfig\n\n# %%\nfig = 3\nfig\n"
    )
    assert rerun_hazards(lesson) == []


@pytest.mark.parametrize("path", LESSONS, ids=os.path.basename)
def test_every_cell_can_run_again(path):
    problems = rerun_hazards(path)
    assert not problems, f"{os.path.basename(path)}:\n  " + "\n  ".join(problems)
