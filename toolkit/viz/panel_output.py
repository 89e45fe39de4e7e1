"""What an explorer panel shows: its figure and a few lines of text, in place of what its Output held.

The explorers (`explorer.py`, `fsdp_explorer.py`, `scale_explorer.py`) redraw by setting their ipywidgets
Output's `outputs` directly rather than printing into it inside `with output:`: the content is then the
same in a notebook, in a test and in a script, and the figure lands in the panel, not under the cell.
"""

from __future__ import annotations


def figure_entry(fig) -> dict:
    """An Output entry for `fig`: the mime bundle of plotly's current renderer (in a notebook, what a cell
    ending in `fig` shows), with a text stand-in where there is none (a test, a script).

    (Not IPython's display formatter: it would *display* the figure, under the cell instead of in the
    Output, because plotly figures have their own `_ipython_display_`.)
    """
    data = dict(fig._repr_mimebundle_())
    data.setdefault("text/plain", f"<figure: {fig.layout.title.text}>")
    return {"output_type": "display_data", "data": data, "metadata": {}}


def show(output, figure, text: str) -> None:
    """Replace what `output` holds with `figure` (None: no figure, e.g. after a bad value) and `text`."""
    shown = (figure_entry(figure),) if figure is not None else ()
    output.outputs = shown + ({"output_type": "stream", "name": "stdout", "text": text + "\n"},)
