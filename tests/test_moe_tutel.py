"""Issue 15, the MoE half: the link's physics, Tutel complete (2DH, EP+DP+MP, dynamic capacity), and the layering.

- Layering: no file of toolkit/moe imports the layer back (the layer sits on top of its parts).
"""
from __future__ import annotations

import ast
import pathlib

import toolkit

MOE = pathlib.Path(toolkit.__file__).parent / "moe"


def test_no_part_of_the_moe_package_imports_the_layer_back():
    for path in sorted(MOE.glob("*.py")):
        if path.name in ("__init__.py", "layer.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.module not in ("layer", "toolkit.moe.layer") and not (
                    node.level == 1 and node.module == "layer"), (
                    f"{path.name} imports from the layer (line {node.lineno}): the layer is built on its parts, "
                    f"so what they need from it belongs in a lower file (moe/plan.py, moe/load.py).")
