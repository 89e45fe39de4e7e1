"""The lessons stay as they are stored when a student runs them in JupyterLab and saves.

A lesson is `notebooks/NN-name.py` (jupytext py:percent, the source) paired with `NN-name.ipynb`,
stored without outputs. Saving in JupyterLab writes both files. Two things would then change them:
jupytext stamps its own version into the .py header (the repository's `jupytext.toml` filters that
out), and the server writes the outputs, execution counts and the kernel's `language_info` into the
.ipynb. `keep_stored_form` is a Jupyter server pre-save hook that removes those from a paired notebook
before it is written, so running a lesson and saving it leaves `git status` clean (and the notebook
tests, which insist on the stored form, pass).

It is switched on for every Jupyter server started from the project's environment: this package is a
(tiny) Jupyter server extension, enabled by `etc/jupyter/jupyter_server_config.d/toolkit-lessons.json`
(which `make setup` puts in .venv), and on loading it registers the hook with the server's contents
manager. Notebooks that are not paired with a text file keep their outputs. It lives beside `toolkit`,
not in it, so that the server does not import torch to load it.

It also opens a lesson as JupyterLab would find one it had just saved (`open_as_saved`), so that the tab is not
marked modified before anything runs: the kernel's `language_info`, which JupyterLab writes into the notebook as
soon as the kernel answers (a change: the tab was marked modified), is there already. (The stored form leaves it
out: it names this machine's Python version.)
"""

from __future__ import annotations

NOTEBOOK_KEYS = ("kernelspec", "jupytext")  # the notebook metadata a lesson stores; the rest is the session's
TRANSIENT_CELL_KEYS = ("execution", "collapsed", "scrolled", "jupyter")  # timings and view state


def is_paired(notebook: dict) -> bool:
    """Is this notebook paired with a text file by jupytext (a lesson), so that its outputs are not stored?"""
    formats = notebook.get("metadata", {}).get("jupytext", {}).get("formats", "")
    formats = ",".join(formats) if isinstance(formats, (list, tuple)) else str(formats)
    return "ipynb" in formats and any(part.strip() and "ipynb" not in part for part in formats.split(","))


def stored_form(notebook: dict) -> dict:
    """The notebook as the repository stores it (changed in place, and returned): no outputs, no execution
    counts, no timings or view state in the cells, and only the kernelspec and jupytext metadata."""
    metadata = notebook.setdefault("metadata", {})
    for key in [k for k in metadata if k not in NOTEBOOK_KEYS]:
        del metadata[key]
    for cell in notebook.get("cells", []):
        for key in TRANSIENT_CELL_KEYS:
            cell.get("metadata", {}).pop(key, None)
        if cell.get("cell_type") == "code":
            cell["outputs"], cell["execution_count"] = [], None
    return notebook


def keep_stored_form(model: dict, **_) -> None:
    """Jupyter server pre-save hook: a paired notebook is written in its stored form."""
    if model.get("type") == "notebook" and isinstance(model.get("content"), dict) and is_paired(model["content"]):
        stored_form(model["content"])


def kernel_language_info(kernel_name: str) -> dict | None:
    """What the kernel `kernel_name` will report as its language_info, where the server knows it: "python3" is
    ipykernel on this server's own Python (the environment the lessons run in)."""
    if kernel_name != "python3":
        return None
    try:
        from ipykernel.ipkernel import IPythonKernel
    except ImportError:
        return None
    return dict(IPythonKernel.language_info)


def open_as_saved(manager) -> None:
    """Wrap `manager.mark_trusted_cells` (the server calls it on every notebook it loads): a paired notebook (a
    lesson) is loaded with the language_info its kernel will report; any other is left as it is."""
    server_verdict = manager.mark_trusted_cells

    def mark_trusted_cells(nb, path=""):
        server_verdict(nb, path)
        if not is_paired(nb):
            return
        metadata = nb.setdefault("metadata", {})
        language = kernel_language_info(metadata.get("kernelspec", {}).get("name", ""))
        if language and "language_info" not in metadata:
            metadata["language_info"] = language

    manager.mark_trusted_cells = mark_trusted_cells


# --- the Jupyter server extension that installs the hook -------------------------------------------------
def _jupyter_server_extension_points():
    return [{"module": "toolkit_lessons"}]


def _load_jupyter_server_extension(server_app) -> None:
    server_app.contents_manager.register_pre_save_hook(keep_stored_form)
    open_as_saved(server_app.contents_manager)
    server_app.log.info("toolkit_lessons: paired notebooks (the lessons) are saved without outputs and open as saved")
