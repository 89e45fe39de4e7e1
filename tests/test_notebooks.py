"""Every lesson notebook runs top to bottom, and is stored paired with its .py and without outputs.

Notebooks run in a fresh kernel with the notebook's folder as working directory, as a student's
would. The .py (jupytext py:percent) is the source of truth; `make notebooks` regenerates the pair.
"""

import glob
import os
import re

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
    assert [(c.cell_type, c.source) for c in from_py.cells] == [(c.cell_type, c.source) for c in stored.cells], (
        f"{_id(path)} differs from {os.path.basename(source)}: run `make notebooks` (jupytext --sync)"
    )


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
    client = NotebookClient(
        nb,
        km=kernel,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": os.path.dirname(path)}},
    )
    try:
        client.execute()  # raises CellExecutionError with the failing cell and its traceback
    finally:  # nbclient stops only a kernel it made itself: this one (and the zygote its launches started)
        kernel.shutdown_kernel(now=True)  # would otherwise outlive the test, to the end of the session
    if os.path.basename(path).startswith(PRINTS_THE_SIMULATOR):
        noise = printed_noise(nb)
        assert not noise, f"{_id(path)} prints numbers no one should read: {noise}"


# Lessons that print the simulator's numbers: what they print is read by the magnitude (toolkit/units.py).
PRINTS_THE_SIMULATOR = ("07-", "08-")
NOISE = {
    "a negative duration": r"(?<![\w.])-\d+(?:\.\d+)?\s?(?:s|ms|µs|us|ns)\b",
    "a duration in scientific notation (residue below a microsecond)": r"\d(?:\.\d+)?e-\d+\s?(?:s|ms|µs|us)\b",
    "a zero in too large a unit": r"(?<![\d.])0\.0+\s?(?:TB|GB|MB|kB|s|ms|TFLOP/s|GB/s)\b",
    "a count in too large a unit": r"(?<![\d.])0\.\d+[KMBT] parameters",
}


def printed_noise(nb) -> list[str]:
    """What the executed notebook printed (streams and text results) that matches a NOISE pattern."""
    found = []
    for i, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            text = output.get("text", "") or output.get("data", {}).get("text/plain", "")
            for what, pattern in NOISE.items():
                found += [f"cell {i}: {what}: {m.group(0)!r}" for m in re.finditer(pattern, text)]
    return found


def test_the_noise_check_catches_what_the_trial_saw():
    printed = [
        "add ddp: -12 ms exposed",
        "3.47e-15 ms hidden",
        "0.000 GB",
        "0.000106B parameters",
        "exposed 1.2 ms, hidden 4.7 µs, 2.79 TB, 106K parameters, loss -0.25, step 12 ms",
    ]
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell(outputs=[nbformat.v4.new_output("stream", name="stdout", text=t)])
            for t in printed
        ]
    )
    assert [f.split(":")[1].strip() for f in printed_noise(nb)] == [
        "a negative duration",
        "a duration in scientific notation (residue below a microsecond)",
        "a zero in too large a unit",
        "a count in too large a unit",
    ]
