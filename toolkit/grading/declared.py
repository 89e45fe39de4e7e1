"""A lab's constants (ANSWERS, BUILDS_ON, INSTRUCTOR_ONLY, MESSAGES_ONLY), read from its checks.py without running it.

The grader, the release and the students' build all need them before (or without) importing a lab's code.
"""

from __future__ import annotations

import ast
from pathlib import Path


def declared(lab: Path, name: str, default):
    """A constant of the lab's checks.py (ANSWERS, INSTRUCTOR_ONLY), read without running the file."""
    try:
        tree = ast.parse((lab / "checks.py").read_text())
    except SyntaxError:
        return default
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            try:
                return ast.literal_eval(node.value)
            except ValueError:
                raise ValueError(
                    f"{lab.name}/checks.py: {name} must be written out as a literal (a dict or list of "
                    "strings), so a release can read it without running the file"
                ) from None
    return default
