"""Mutants of a lab's reference solution: the nearly-right answers its checks must tell from the right one.

Only what a student writes is mutated: every function of `solution.py` that the skeleton leaves to write (its body
raises NotImplementedError there) or does not have at all (a helper of the answer); the given code stays. Each
mutant changes one thing, the mistakes students make:

    arithmetic    + <-> -, * <-> /, // -> /, % -> //; an operand dropped (a missing division by N, a missing + 1)
    off by one    an integer constant k -> k + 1 and k - 1 (an index, a step, a chunk)
    comparisons   < <-> <=, > <-> >=, == <-> !=, is <-> is not, in <-> not in; and <-> or; not x -> x; -x -> x
    flags, ops    True <-> False (async_op, a blocking call); "avg" <-> "sum" (the wrong reduce op); min <-> max;
                  isend <-> irecv; += -> -=, += -> =
    arguments     the first two positional arguments of a call swapped (send/receive order, rank or chunk)
    statements    a call or an attribute assignment left out (a missing wait, a missing collective, a state
                  not set); two neighbouring statements swapped (the wrong order)

`mutants(solution, skeleton)` lists them; `toolkit.grading.mutants` runs a lab's checks against them.
"""

from __future__ import annotations

import ast
import copy
from dataclasses import dataclass

SWAP_OPS = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Div,
    ast.Mod: ast.FloorDiv,
}
SWAP_COMPARE = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
SWAP_STRINGS = {"avg": "sum", "sum": "avg", "max": "min", "min": "max"}
SWAP_NAMES = {"min": "max", "max": "min", "isend": "irecv", "irecv": "isend"}
SYMBOL = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Is: "is",
    ast.IsNot: "is not",
    ast.In: "in",
    ast.NotIn: "not in",
}


@dataclass(frozen=True)
class Mutant:
    """One change to the reference: where (function, line), what (before -> after), and the whole mutated file."""

    function: str
    line: int
    what: str
    source: str

    @property
    def id(self) -> str:
        return f"{self.function} line {self.line}: {self.what}"


def students_functions(solution: ast.Module, skeleton: ast.Module) -> set[str]:
    """Qualified names of the solution's functions a student writes: not given with a body in the skeleton."""

    def functions(tree):
        found = {}

        def visit(body, prefix):
            for node in body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found[prefix + node.name] = node
                elif isinstance(node, ast.ClassDef):
                    visit(node.body, prefix + node.name + ".")

        visit(tree.body, "")
        return found

    given = {
        name
        for name, node in functions(skeleton).items()
        if not any(isinstance(n, ast.Raise) and "NotImplementedError" in ast.unparse(n) for n in ast.walk(node))
    }
    return {name for name in functions(solution) if name not in given}


def _short(node) -> str:
    text = ast.unparse(node).replace("\n", " ")
    return text if len(text) <= 60 else text[:57] + "..."


class _Sites(ast.NodeTransformer):
    """Walks the students' functions; counts every mutation site, and applies the one numbered `target`."""

    def __init__(self, functions: set[str], target: int = -1):
        self.functions, self.target, self.count = functions, target, 0
        self.prefix, self.inside, self.applied = [], None, None

    # --- where we are ---------------------------------------------------------------------------------------------
    def visit_ClassDef(self, node):
        self.prefix.append(node.name)
        self.generic_visit(node)
        self.prefix.pop()
        return node

    def visit_FunctionDef(self, node):
        name = ".".join(self.prefix + [node.name])
        if self.inside is None and name in self.functions:  # its body only: not its signature's defaults
            self.inside = name
            node.body = [self.visit(stmt) for stmt in self._statements(node.body)]
            self.inside = None
            return node
        self.prefix.append(node.name)
        self.generic_visit(node)
        self.prefix.pop()
        return node

    visit_AsyncFunctionDef = visit_FunctionDef

    def _site(self, node, what) -> bool:
        """One more mutation site; True when it is the one to apply."""
        self.count += 1
        if self.count - 1 == self.target:
            self.applied = (self.inside, getattr(node, "lineno", 0), what)
            return True
        return False

    # --- statements: left out, or swapped with the next ------------------------------------------------------------
    def _statements(self, body: list) -> list:
        body = list(body)
        docstring = (
            body[:1] if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else []
        )
        for i, stmt in enumerate(body):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
            left_out = (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)) or (
                isinstance(stmt, (ast.Assign, ast.AugAssign)) and any(isinstance(t, ast.Attribute) for t in targets)
            )
            if left_out and len(body) > 1 and self._site(stmt, f"`{_short(stmt)}` left out"):
                body[i] = ast.copy_location(ast.Pass(), stmt)
                return body
        for i in range(len(docstring), len(body) - 1):
            a, b = body[i], body[i + 1]
            simple = (ast.Expr, ast.Assign, ast.AugAssign)
            if (
                isinstance(a, simple)
                and isinstance(b, simple)
                and ast.dump(a) != ast.dump(b)
                and self._site(a, f"`{_short(a)}` and `{_short(b)}` swapped")
            ):
                body[i], body[i + 1] = b, a
                return body
        return body

    def generic_visit(self, node):
        for field in ("body", "orelse", "finalbody"):
            if (
                self.inside is not None
                and isinstance(getattr(node, field, None), list)
                and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module, ast.ClassDef))
            ):
                setattr(node, field, self._statements(getattr(node, field)))
        return super().generic_visit(node)

    # --- expressions ------------------------------------------------------------------------------------------------
    def visit_BinOp(self, node):
        if self.inside is not None:
            swapped = SWAP_OPS.get(type(node.op))
            if swapped and self._site(node, f"`{SYMBOL[type(node.op)]}` -> `{SYMBOL[swapped]}` in `{_short(node)}`"):
                return ast.copy_location(ast.BinOp(node.left, swapped(), node.right), node)
            if type(node.op) in SWAP_OPS and self._site(node, f"`{_short(node)}` -> `{_short(node.left)}`"):
                return node.left
        return self.generic_visit(node)

    def visit_AugAssign(self, node):
        if self.inside is not None and isinstance(node.op, (ast.Add, ast.Sub)):
            other = ast.Sub if isinstance(node.op, ast.Add) else ast.Add
            if self._site(node, f"`{_short(node)}`: `{SYMBOL[type(node.op)]}=` -> `{SYMBOL[other]}=`"):
                return ast.copy_location(ast.AugAssign(node.target, other(), node.value), node)
            if self._site(node, f"`{_short(node)}`: `{SYMBOL[type(node.op)]}=` -> `=`"):
                return ast.copy_location(ast.Assign([node.target], node.value, lineno=node.lineno), node)
        return self.generic_visit(node)

    def visit_Compare(self, node):
        if self.inside is not None:
            for k, op in enumerate(node.ops):
                swapped = SWAP_COMPARE.get(type(op))
                if swapped and self._site(node, f"`{SYMBOL[type(op)]}` -> `{SYMBOL[swapped]}` in `{_short(node)}`"):
                    ops = list(node.ops)
                    ops[k] = swapped()
                    return ast.copy_location(ast.Compare(node.left, ops, node.comparators), node)
        return self.generic_visit(node)

    def visit_BoolOp(self, node):
        if self.inside is not None:
            other = ast.Or if isinstance(node.op, ast.And) else ast.And
            if self._site(node, f"`{_short(node)}`: `{type(node.op).__name__.lower()}` -> `{other.__name__.lower()}`"):
                return ast.copy_location(ast.BoolOp(other(), node.values), node)
        return self.generic_visit(node)

    def visit_UnaryOp(self, node):
        if (
            self.inside is not None
            and isinstance(node.op, (ast.USub, ast.Not))
            and self._site(node, f"`{_short(node)}` -> `{_short(node.operand)}`")
        ):
            return node.operand
        return self.generic_visit(node)

    def visit_Constant(self, node):
        if self.inside is None:
            return node
        value = node.value
        if isinstance(value, bool):
            if self._site(node, f"`{value}` -> `{not value}`"):
                return ast.copy_location(ast.Constant(not value), node)
        elif isinstance(value, int) and -2 <= value <= 16:
            for new in (value + 1, value - 1):
                if self._site(node, f"`{value}` -> `{new}`"):
                    return ast.copy_location(ast.Constant(new), node)
        elif (
            isinstance(value, str)
            and value in SWAP_STRINGS
            and self._site(node, f"`{value!r}` -> `{SWAP_STRINGS[value]!r}`")
        ):
            return ast.copy_location(ast.Constant(SWAP_STRINGS[value]), node)
        return node

    def visit_Name(self, node):
        if (
            self.inside is not None
            and node.id in SWAP_NAMES
            and isinstance(node.ctx, ast.Load)
            and self._site(node, f"`{node.id}` -> `{SWAP_NAMES[node.id]}`")
        ):
            return ast.copy_location(ast.Name(SWAP_NAMES[node.id], node.ctx), node)
        return node

    def visit_Attribute(self, node):
        if (
            self.inside is not None
            and node.attr in SWAP_NAMES
            and self._site(node, f"`{_short(node)}` -> `.{SWAP_NAMES[node.attr]}`")
        ):
            node = copy.copy(node)
            node.attr = SWAP_NAMES[node.attr]
            return node
        return self.generic_visit(node)

    def visit_Call(self, node):
        if (
            self.inside is not None
            and len(node.args) >= 2
            and ast.dump(node.args[0]) != ast.dump(node.args[1])
            and not any(isinstance(a, ast.Starred) for a in node.args[:2])
            and self._site(node, f"`{_short(node.args[0])}` and `{_short(node.args[1])}` swapped in `{_short(node)}`")
        ):
            return ast.copy_location(
                ast.Call(node.func, [node.args[1], node.args[0], *node.args[2:]], node.keywords), node
            )
        return self.generic_visit(node)


def mutants(solution: str, skeleton: str) -> list[Mutant]:
    """Every single-change mutant of `solution` (a reference's source) inside the functions a student writes."""
    tree, functions = ast.parse(solution), students_functions(ast.parse(solution), ast.parse(skeleton))
    counter = _Sites(functions)
    counter.visit(copy.deepcopy(tree))
    found, seen = [], {ast.dump(tree)}
    for target in range(counter.count):
        site = _Sites(functions, target)
        mutated = ast.fix_missing_locations(site.visit(copy.deepcopy(tree)))
        dumped = ast.dump(mutated)
        if site.applied is None or dumped in seen:  # the same program twice (or the reference) is one mutant, or none
            continue
        seen.add(dumped)
        function, line, what = site.applied
        found.append(Mutant(function, line, what, ast.unparse(mutated) + "\n"))
    return found
