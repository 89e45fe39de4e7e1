"""The rooms under the figures import no figure: what runs a step, a collective or a simulation needs neither
`toolkit.viz` nor a plotting library, so a machine with torch and a few small packages runs them (a lent GPU
machine with no package index: `make test-gpu PY=python3`). Found when the simulator's calibration of this machine
fitted its links through `toolkit.viz` and so needed plotly."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "toolkit"
BELOW_THE_FIGURES = ("runtime", "comm", "trace", "memory", "parallel", "moe", "models", "sim")
FIGURES = ("plotly", "ipywidgets", "matplotlib")  # (IPython is the %%px engines' runtime, not a figure)


def _imports(path: pathlib.Path, root: pathlib.Path = ROOT):
    """Every module a file imports, at its top or inside a function, resolved against the package."""
    package = path.relative_to(root.parent).with_suffix("").parts[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            yield ".".join([*base, *(node.module.split(".") if node.module else [])])


def test_no_room_below_the_figures_imports_a_figure():
    found = [
        f"{path.relative_to(ROOT.parent)} imports {name}"
        for room in BELOW_THE_FIGURES
        for path in sorted((ROOT / room).rglob("*.py"))
        for name in _imports(path)
        if name.startswith("toolkit.viz") or name.split(".")[0] in FIGURES
    ]
    assert not found, found


def test_the_scan_sees_a_figure_imported_inside_a_function(tmp_path):
    """The check itself can fail: the import that was there, inside a function, relative to the package."""
    planted = tmp_path / "toolkit" / "sim" / "calibrate.py"
    planted.parent.mkdir(parents=True)
    planted.write_text(
        "import plotly.graph_objects as go\n\ndef measure():\n    from ..viz.bandwidth import fit_alpha_beta\n"
    )
    assert list(_imports(planted, tmp_path / "toolkit")) == ["plotly.graph_objects", "toolkit.viz.bandwidth"]
