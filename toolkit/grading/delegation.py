"""A submission that hands the lab's work to the toolkit's own implementation scores zero for it, and is told.

A lab's `checks.py` names its answers: `ANSWERS = {"toolkit.comm.ring": "the toolkit's ring collectives"}`.
An answer is a module (every function and method defined in it), `module:name` (one function or class)
or `module:Class.method` (one method: the lab's skeleton may subclass `Class` and use its other methods).
Two looks, because each misses what the other sees:

- `scan(source, answers)`, in the grader, before anything runs: the file names an answer (an import, a
  dotted name, a string such as `importlib.import_module("toolkit.comm.ring")`). Every check scores 0.
- `watch(answers, file)`, on the rank, before the submission is imported: every answer function is replaced
  by one that notes a call made from the submission's file (the toolkit calling its own code, as FSDP
  calls a unit's methods, is not the student's). A check during which the submission called an answer
  scores 0 (an answer reached another way: a computed name, a getattr).

Both can be beaten by a student set on cheating (code that rebuilds the function from its bytecode, say);
what they guarantee is that an import-and-call of the toolkit's answer, the easy way to a full score,
scores zero and says why. The ranks import the students' toolkit (`student_wheel.for_lab`, what `python -m
toolkit release --wheel` packs), where an answer only raises: the watcher is the second line, which says why a
check scored 0.
"""

from __future__ import annotations

import ast
import functools
import importlib
import pkgutil
import sys
import sysconfig
import types

CALLED: set[str] = set()  # answers the submission called since the last `take()`, on this rank
SUBMISSION = [""]  # the submission's file, as its code objects name it (set by `watch`)
_STDLIB = sysconfig.get_paths()["stdlib"]


def _parts(spec: str) -> tuple[str, str]:
    module, _, name = spec.partition(":")
    return module, name


def _dotted(node) -> str | None:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id] + names[::-1])
    return None


def references(source: str) -> tuple[set[str], set[str]]:
    """(every dotted name the source imports or uses, aliases resolved; every short string it spells)."""
    tree = ast.parse(source)
    aliases, found, strings = {}, set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                found.add(a.name)
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            for a in node.names:
                found.add(f"{node.module}.{a.name}")
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, (ast.Attribute, ast.Name)):
            name = _dotted(node)
            if name:
                head, _, rest = name.partition(".")
                found.add(".".join(filter(None, [aliases.get(head, head), rest])))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) < 200:
            strings.add(node.value.strip())
    return found, strings


def _names(reference: str, spec: str) -> bool:
    """The dotted `reference` names the answer `spec`, or something inside it: by its module's path or by a
    package above it that re-exports it (`toolkit.memory.alpha_beta_time`, `toolkit.moe.MoE.forward`)."""
    module, name = _parts(spec)
    parts = module.split(".")
    homes = [module] + ([".".join(parts[:k]) for k in range(len(parts) - 1, 0, -1)] if name else [])
    for home in homes:
        target = f"{home}.{name}" if name else home
        if reference == target or reference.startswith(target + "."):
            return True
    return False


def scan(source: str, answers: dict) -> list[str]:
    """The answers this source names, as messages ("uses toolkit.comm.ring (the toolkit's ring)")."""
    try:
        found, strings = references(source)
    except (SyntaxError, ValueError):
        return []
    return [
        f"{spec.replace(':', '.')} ({why})"
        for spec, why in answers.items()
        if any(_names(ref, spec) for ref in found | strings)
    ]


def delegation_message(uses: list[str]) -> str:
    return (
        "this check scores 0: your code uses " + "; ".join(uses) + ", which is the toolkit's own "
        "implementation of what this lab asks you to write. Write it yourself (the lab's README says what "
        "it must do), and grade again."
    )


# --- on the rank -------------------------------------------------------------------------------------------
def _called_by_the_submission() -> bool:
    """The nearest caller outside the standard library is the submission's file (not the toolkit calling
    its own code, as FSDP calls its units' methods or MoE(shadow=[...]) its predictor)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name == SUBMISSION[0]:
            return True
        if not name.startswith(_STDLIB) or "-packages" in name:
            return False
        frame = frame.f_back
    return False


def _noting(fn, name: str):
    def watched(*args, **kwargs):
        if _called_by_the_submission():
            CALLED.add(name)
        return fn(*args, **kwargs)

    functools.update_wrapper(watched, fn, updated=())  # the name and docstring, no __wrapped__
    del watched.__wrapped__
    return watched


def _functions(module, name: str):
    """(owner, attribute, function, full name) for every function the spec covers."""
    if not name:
        for attr, value in list(vars(module).items()):
            if getattr(value, "__module__", None) != module.__name__:
                continue
            if isinstance(value, types.FunctionType):
                yield module, attr, value, f"{module.__name__}.{attr}"
            elif isinstance(value, type):
                yield from _methods(value, None, f"{module.__name__}.{attr}")
        return
    owner_name, _, method = name.partition(".")
    value = getattr(module, owner_name)
    if isinstance(value, type):
        yield from _methods(value, method or None, f"{module.__name__}.{owner_name}")
    elif isinstance(value, types.FunctionType):
        yield module, owner_name, value, f"{module.__name__}.{owner_name}"


def _methods(cls, only, prefix):
    for attr, value in list(vars(cls).items()):
        if only is not None and attr != only:
            continue
        if isinstance(value, (staticmethod, classmethod)):
            yield cls, attr, value, f"{prefix}.{attr}"
        elif isinstance(value, types.FunctionType):
            yield cls, attr, value, f"{prefix}.{attr}"


def _with_submodules(module) -> list:
    """A module, or a package and every module in it (`toolkit.parallel.tensor` is a folder of files)."""
    found = [module]
    for info in pkgutil.walk_packages(
        getattr(module, "__path__", []), module.__name__ + ".", onerror=lambda name: None
    ):
        try:
            found.append(importlib.import_module(info.name))
        except Exception:  # noqa: BLE001 - in the students' build a module may raise at import (an answer it runs)
            pass
    return found


def watch(answers, submission: str) -> None:
    """Replace every answer function by one that notes when the submission (the file `submission`) calls it
    (in its module, its class, every loaded module that imported it by name, and its module's tables of
    functions). Call before the submission is imported."""
    SUBMISSION[0] = submission
    for spec in answers:
        module_name, name = _parts(spec)
        try:
            modules = (
                _with_submodules(importlib.import_module(module_name))
                if not name
                else [importlib.import_module(module_name)]
            )
            targets = [t for module in modules for t in _functions(module, name)]
        except Exception:  # noqa: BLE001 - not there, or not importable in the students' build: nothing to call
            continue
        for owner, attr, value, full in targets:
            if isinstance(value, (staticmethod, classmethod)):
                replacement = type(value)(_noting(value.__func__, full))
            else:
                replacement = _noting(value, full)
            setattr(owner, attr, replacement)
            if isinstance(owner, types.ModuleType):
                for other in list(sys.modules.values()):
                    holder = getattr(other, "__dict__", {})
                    for key, held in list(holder.items()):
                        if held is value:
                            holder[key] = replacement
                _in_tables(owner, value, replacement)


def _in_tables(module, value, replacement) -> None:
    """A module's own tables of its functions (`SCHEDULES = {"1f1b": one_f_one_b, ...}`) hand out the watched one."""
    for name, table in list(vars(module).items()):
        if isinstance(table, dict) and not name.startswith("__"):
            for key, held in list(table.items()):
                if held is value:
                    table[key] = replacement


def take() -> list[str]:
    """The answers called since the last take (and forget them)."""
    called = sorted(CALLED)
    CALLED.clear()
    return called
