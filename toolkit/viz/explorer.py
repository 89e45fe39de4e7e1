"""The memory explorer: how many bytes of model states each rank holds, under data parallelism and ZeRO 1-3.

Move the sliders (Ψ parameters, N ranks, K optimizer bytes per parameter, the precision of parameters
and gradients) and the bars redraw: parameters, gradients and optimizer states per rank for each stage,
with the totals printed under them. With the defaults it is the ZeRO paper's Figure 1 (Ψ = 7.5B,
N = 64, K = 12, mixed precision): 120 / 31.4 / 16.6 / 1.9 GB per GPU.

Two layers, so the numbers can be tested without a screen:

- `explorer_numbers(...)` (`zero_stages.py`): a pure function, the numbers the panel shows (bytes per rank
  per stage, the formula, and the largest model that fits in a given device memory);
- here, what is shown of them (`explorer_figure`, `summary_text`) and `memory_explorer(...)` ->
  `MemoryExplorer`, the ipywidgets panel around them. Building it runs nothing expensive; every change
  of a control recomputes the numbers and redraws (`figure`, `numbers` and the Output's content hold
  what is shown).

Only the theory (`toolkit.memory.model_states_breakdown`) is drawn here: activations, temporary
buffers and fragmentation come on top (the measured bars of notebook 03 show how much).
"""

from __future__ import annotations

import math

import ipywidgets as widgets

from ..units import count_text
from . import style
from .memory import model_states_bars
from .panel_output import show
from .zero_stages import GB, STAGE_NAMES, explorer_numbers

PRECISION_LABELS = {"mixed": "16-bit params + grads (2 + 2 B)", "fp32": "fp32 params + grads (4 + 4 B)"}
WORLD_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


def _gb(x: float) -> str:
    """A total in GB as the paper prints it (120.0, 31.4, 1.9), with more digits below 1 GB."""
    return f"{x:.1f}" if x >= 0.95 else f"{x:.2g}"


def summary_text(numbers: dict, highlight: int | None = None) -> str:
    """The per-rank totals as a few lines of text (what the panel prints under the figure)."""
    n = numbers
    header = f"{'':2}{'stage':<14}{'formula':<16}{'per rank':>11}{'B/param':>9}"
    if n["device_gb"]:
        header += f"{'fits ' + format(n['device_gb'], 'g') + ' GB?':>15}{'largest Ψ that fits':>22}"
    lines = [
        f"Ψ = {count_text(n['num_params'])} parameters, N = {n['world_size']} ranks, "
        f"K = {n['optimizer_multiplier']:g}, P + G = {n['param_bytes']} + {n['grad_bytes']} bytes per parameter",
        header,
    ]
    for s in n["stages"]:
        mark = "▶ " if s["stage"] == highlight else "  "
        line = f"{mark}{s['name']:<14}{s['formula']:<16}{_gb(s['total_gb']):>8} GB{s['bytes_per_param']:>9.3g}"
        if n["device_gb"]:
            line += f"{'yes' if s['fits'] else 'no':>15}{count_text(s['max_params']):>22}"
        lines.append(line)
    if highlight is not None:
        s = n["stages"][highlight]
        lines.append(
            f"{s['name']} partitions {s['sharded']}: params {s['params'] / GB:.3g} GB + grads "
            f"{s['grads'] / GB:.3g} GB + optimizer {s['optimizer'] / GB:.3g} GB = {s['total_gb']:.3g} GB "
            "per rank (activations and buffers come on top)."
        )
    return "\n".join(lines)


def explorer_figure(numbers: dict, highlight: int | None = None):
    """The stacked bars of `model_states_bars` for these numbers; the highlighted stage in full colour,
    the others faded; the device's memory as a dashed line when given."""
    n = numbers
    fig = model_states_bars(
        n["num_params"],
        n["world_size"],
        optimizer_multiplier=n["optimizer_multiplier"],
        param_bytes=n["param_bytes"],
        grad_bytes=n["grad_bytes"],
        unit=GB,
    )
    if highlight is not None:
        opacity = [1.0 if s == highlight else 0.35 for s in range(4)]
        fig.update_traces(marker_opacity=opacity, selector=dict(type="bar"))
    if n["device_gb"]:
        fig.add_hline(
            y=n["device_gb"],
            line_dash="dash",
            line_color=style.ALERT,
            annotation_text=f"device memory {n['device_gb']:g} GB",
            annotation_position="top right",
        )
    fig.update_traces(text=[f"{_gb(t)} GB" for t in n["totals_gb"]], selector=dict(mode="text"))
    top = max(max(n["totals_gb"]), n["device_gb"] or 0)
    fig.update_yaxes(range=[0, 1.15 * top if top > 0 else 1])
    style.place_title(
        fig,
        "Model states per rank under DP and ZeRO 1, 2, 3",
        f"Ψ = {count_text(n['num_params'])} parameters, N = {n['world_size']} ranks, "
        f"K = {n['optimizer_multiplier']:g}, {PRECISION_LABELS[n['precision']]}",
    )
    return fig


class MemoryExplorer:
    """Sliders and dropdowns over an Output holding the figure and the printed totals. Display it
    (last line of a cell) to use it. `numbers`, `figure` and `text` hold what is shown now;
    `redraws` counts the redraws."""

    def __init__(
        self,
        num_params: float = 7.5e9,
        world_size: int = 64,
        optimizer_multiplier: float = 12,
        *,
        stage: int | None = None,
        precision: str = "mixed",
        device_gb: float | None = 80,
        psi_range: tuple = (1e8, 1e12),
    ):
        if stage not in (None, 0, 1, 2, 3):
            raise ValueError(f"stage must be 0, 1, 2, 3 or None (none highlighted), got {stage!r}.")
        explorer_numbers(num_params, world_size, optimizer_multiplier, precision, device_gb=device_gb)  # checks
        lo, hi = psi_range
        style, wide = {"description_width": "150px"}, widgets.Layout(width="480px")
        self.num_params = widgets.FloatLogSlider(
            value=num_params,
            base=10,
            min=math.log10(min(lo, num_params)),
            max=math.log10(max(hi, num_params)),
            step=0.005,
            readout_format=".3g",
            description="Ψ parameters",
            style=style,
            layout=wide,
            continuous_update=False,
        )
        worlds = sorted(set(WORLD_SIZES) | {int(world_size)})
        self.world_size = widgets.SelectionSlider(
            options=worlds,
            value=int(world_size),
            description="N ranks",
            style=style,
            layout=wide,
            continuous_update=False,
        )
        self.optimizer_multiplier = widgets.IntSlider(
            value=int(optimizer_multiplier),
            min=0,
            max=max(24, int(optimizer_multiplier)),
            description="K bytes/param",
            style=style,
            layout=wide,
            continuous_update=False,
        )
        stages = [("none highlighted", None)] + [(name, s) for s, name in enumerate(STAGE_NAMES)]
        self.stage = widgets.Dropdown(options=stages, value=stage, description="highlight stage", style=style)
        self.precision = widgets.Dropdown(
            options=[(label, key) for key, label in PRECISION_LABELS.items()],
            value=precision,
            description="params, grads",
            style=style,
            layout=widgets.Layout(width="480px"),
        )
        self.device_gb = widgets.BoundedFloatText(
            value=device_gb or 0, min=0, max=1e6, step=8, description="device GB (0: none)", style=style
        )
        self.help = widgets.HTML(
            "<small>K: bytes of optimizer state per parameter. Mixed-precision Adam keeps an fp32 master copy, "
            "momentum and variance: K = 12 (some lectures add an fp32 gradient copy: 16). Pure fp32 Adam needs "
            "no master copy: K = 8.</small>"
        )
        self.output = widgets.Output()
        self.numbers, self.figure, self.text, self.redraws = None, None, "", 0
        self.controls = (
            self.num_params,
            self.world_size,
            self.optimizer_multiplier,
            self.stage,
            self.precision,
            self.device_gb,
        )
        for control in self.controls:
            control.observe(self.redraw, names="value")
        self.widget = widgets.VBox(
            [
                widgets.HBox(
                    [
                        widgets.VBox([self.num_params, self.world_size, self.optimizer_multiplier]),
                        widgets.VBox([self.precision, self.stage, self.device_gb]),
                    ]
                ),
                self.help,
                self.output,
            ]
        )
        self.redraw()

    def settings(self) -> dict:
        """explorer_numbers' arguments for the current choices."""
        return {
            "num_params": self.num_params.value,
            "world_size": self.world_size.value,
            "optimizer_multiplier": self.optimizer_multiplier.value,
            "precision": self.precision.value,
            "device_gb": self.device_gb.value or None,
        }

    def redraw(self, _change=None) -> None:
        """Recompute and redraw (every control calls it on a change; callable directly too)."""
        try:
            self.numbers = explorer_numbers(**self.settings())
            self.figure = explorer_figure(self.numbers, self.stage.value)
            self.text = summary_text(self.numbers, self.stage.value)
            shown = self.figure
        except ValueError as exc:  # a bad value typed in: say so, keep the panel
            self.text, shown = f"{exc}", None
        show(self.output, shown, self.text)
        self.redraws += 1

    def _repr_mimebundle_(self, **kwargs):  # shown as the widget when it ends a cell
        return self.widget._repr_mimebundle_(**kwargs)


def memory_explorer(
    num_params: float = 7.5e9, world_size: int = 64, optimizer_multiplier: float = 12, **options
) -> MemoryExplorer:
    """The interactive memory explorer (see `MemoryExplorer`); the defaults show the ZeRO paper's Figure 1.

    options: stage (the stage to highlight, or None), precision ("mixed" 2 + 2 or "fp32" 4 + 4 bytes
    for parameters and gradients), device_gb (a device's memory drawn as a line; None for none),
    psi_range (the Ψ slider's ends, default 1e8..1e12).
    """
    return MemoryExplorer(num_params, world_size, optimizer_multiplier, **options)
