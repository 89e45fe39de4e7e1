"""A small ipywidgets panel: pick a collective, a message size and a world size, launch, look.

Why a panel: the timeline of one collective is the quickest way to feel what a world size or a message
size does to it, and re-running a cell with edited numbers breaks the flow. Building the panel runs
nothing (a notebook executed headless never blocks on it); only the button launches ranks, through
a measuring function (by default `toolkit.comm.measure.measure_collectives`), and redraws.

The figure is drawn into an ipywidgets Output. (A plotly FigureWidget would update in place, but it
needs the optional `anywidget` package; an Output works in every Jupyter front end.)
"""

from __future__ import annotations

import ipywidgets as widgets
from IPython.display import clear_output, display

from ..comm.measure_table import KiB, MiB, format_table, size_label
from ..comm.switch import OPERATIONS
from .timeline import timeline

PANEL_SIZES = (1 * KiB, 16 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
IMPLEMENTATION_CHOICES = {"backend and ring": ("backend", "ring"), "backend": ("backend",), "ring": ("ring",)}


def _default_measure(**kwargs):
    from ..comm.measure import measure_collectives

    return measure_collectives(**kwargs)


class CollectivePanel:
    """Controls, a launch button and an output area. Display it (last line of a cell) to use it.

    measure: a function taking keyword arguments world_size, ops, sizes, impls, warmup, repeats and
    returning (records, run), like `measure_collectives`. After a launch, `records`, `run` and
    `figure` hold what was measured and drawn.
    """

    def __init__(
        self,
        measure=None,
        *,
        ops=OPERATIONS,
        sizes=PANEL_SIZES,
        world_sizes=(2, 3, 4),
        repeats: int = 3,
        warmup: int = 1,
    ):
        self.measure = measure or _default_measure
        self.repeats, self.warmup = repeats, warmup
        self.records, self.run, self.figure = None, None, None
        self.operation = widgets.Dropdown(options=list(ops), value=ops[0], description="operation")
        self.size = widgets.SelectionSlider(
            options=[(size_label(s), s) for s in sizes], value=sizes[len(sizes) // 2], description="message"
        )
        self.world_size = widgets.IntSlider(
            value=world_sizes[-1], min=min(world_sizes), max=max(world_sizes), description="ranks"
        )
        self.implementation = widgets.Dropdown(
            options=list(IMPLEMENTATION_CHOICES), value="backend and ring", description="run on"
        )
        self.button = widgets.Button(description="Launch and draw", button_style="primary", icon="play")
        self.status = widgets.HTML(value="<i>Pick a collective and press the button: ranks start on click.</i>")
        self.output = widgets.Output()
        self.button.on_click(self.launch)
        self.widget = widgets.VBox(
            [
                widgets.HBox([self.operation, self.implementation]),
                widgets.HBox([self.size, self.world_size]),
                widgets.HBox([self.button, self.status]),
                self.output,
            ]
        )

    def settings(self) -> dict:
        """The measuring function's keyword arguments for the current choices."""
        return {
            "world_size": self.world_size.value,
            "ops": (self.operation.value,),
            "sizes": (self.size.value,),
            "impls": IMPLEMENTATION_CHOICES[self.implementation.value],
            "warmup": self.warmup,
            "repeats": self.repeats,
        }

    def launch(self, _button=None) -> None:
        """Measure with the current choices and redraw (the button's handler; callable directly too)."""
        chosen = self.settings()
        self.button.disabled = True
        self.status.value = (
            f"running {chosen['ops'][0]} of {size_label(chosen['sizes'][0])} on {chosen['world_size']} ranks…"
        )
        try:
            self.records, self.run = self.measure(**chosen)
            self.figure = timeline(
                self.run,
                title=f"{chosen['ops'][0]}, {size_label(chosen['sizes'][0])}, "
                f"{chosen['world_size']} ranks ({self.repeats} timed calls each)",
            )
            with self.output:
                clear_output(wait=True)
                display(self.figure)
                print(format_table(self.records))
            self.status.value = (
                "done: hover a span for its bytes, duration and bandwidth."
                if self.records
                else f"nothing was timed: {chosen['ops'][0]} has no hand-written version; pick 'backend'."
            )
        except Exception as exc:  # noqa: BLE001 - a student should read the error, not lose the panel
            self.status.value = f"<b>failed</b>: {type(exc).__name__}"
            with self.output:
                clear_output(wait=True)
                print(f"{type(exc).__name__}: {exc}")
        finally:
            self.button.disabled = False

    def _repr_mimebundle_(self, **kwargs):  # shown as the widget when it ends a cell
        return self.widget._repr_mimebundle_(**kwargs)


def collective_panel(measure=None, **options) -> CollectivePanel:
    """Build the panel (nothing runs until its button is pressed); see `CollectivePanel`."""
    return CollectivePanel(measure, **options)
