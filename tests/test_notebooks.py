"""Every lesson notebook runs top to bottom, and is stored paired with its .py and without outputs.

Notebooks run in a fresh kernel with the notebook's folder as working directory, as a student's
would. The .py (jupytext py:percent) is the source of truth; `make notebooks` regenerates the pair.
"""
import glob
import os

import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
CELL_TIMEOUT_S = 180


def _id(path):
    return os.path.basename(path)


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks/*.ipynb found"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_id)
def test_notebook_is_paired_and_stored_clean(path):
    source = path[: -len(".ipynb")] + ".py"
    assert os.path.exists(source), f"{_id(path)} has no paired {os.path.basename(source)} (jupytext py:percent)"
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert not cell.outputs, f"{_id(path)} cell {i} is stored with outputs; clear them"
            assert cell.execution_count is None, f"{_id(path)} cell {i} is stored with an execution count"
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_id)
def test_notebook_matches_its_source(path):
    jupytext = pytest.importorskip("jupytext")
    source = path[: -len(".ipynb")] + ".py"
    from_py = jupytext.read(source)
    stored = nbformat.read(path, as_version=4)
    assert [(c.cell_type, c.source) for c in from_py.cells] == [(c.cell_type, c.source) for c in stored.cells], \
        f"{_id(path)} differs from {os.path.basename(source)}: run `make notebooks` (jupytext --sync)"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_id)
def test_notebook_runs_top_to_bottom(path, tmp_path):
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    # The kernel talks over Unix sockets, not TCP: a TCP kernel picks five free ports and binds them later, and a
    # rendezvous or engine started meanwhile by another test can take one (CI saw the heartbeat's port taken, and
    # the client then waited forever on its heartbeat thread).
    # the kernel runs in the notebook's folder: the sockets' path must be absolute
    kernel = KernelManager(kernel_name="python3", transport="ipc", ip=str(tmp_path / "kernel"))
    client = NotebookClient(nb, km=kernel, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": os.path.dirname(path)}})
    client.execute()  # raises CellExecutionError with the failing cell and its traceback
