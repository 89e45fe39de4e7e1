"""Lesson 07's "Try it": a model, a strategy, a number of GPUs and a cluster; does it fit, and how fast is it?

Each click of "simulate" runs the strategy's own code for rank 0 of the chosen cluster on meta tensors
(`toolkit.sim`), at the model's full width, with three and with four of its layers (with one block in k
checkpointed, two depths k apart), and extrapolates to its full depth (`toolkit.sim.sweep`: every layer, or
every k layers, adds the same). Then it draws what the rank holds at its peak,
every category, against the GPU's memory, and says whether it fits (and, if not, what would make it fit)
and, when it fits, the step's time, TFLOP/s per GPU and MFU on that cluster.

Two layers, so that the numbers can be tested without a screen:

- `scale_case(...)`: a pure function, the numbers (a `sweep` row) for one choice;
- `scale_explorer()` -> `ScaleExplorer`: the ipywidgets panel around it. `row`, `figure` and `text` hold
  what is shown, `redraws` counts the redraws. (Not `widgets.interactive(manual=True)`: it discards what
  its function returns, so a figure returned from it is never redrawn.)

Choices that do not apply are not offered: MoE models train their dense part with ddp (their experts are
expert-parallel). Activation checkpointing is an option of every strategy: of every block, or of one block in 2
or 4 (`activation_checkpointing=k`), memory traded for recomputation in steps, or of every block by operation ("op").
"""

from __future__ import annotations

import ipywidgets as widgets

from ..models.presets import PRESETS
from ..parallel.checkpointing import period
from ..sim.sweep import depths, sweep
from ..units import bytes_text, count_text, seconds_text
from .memory import peak_bars
from .panel_output import show

MODELS = {
    "GPT-3 175B": "gpt3-175b",
    "ZeRO's 7.5B": "zero-7.5b",
    "GPT-2 XL": "gpt2-xl",
    "MoE-GPT-S (16 experts)": "moe-gpt-s",
}
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp")
MOE_STRATEGIES = ("ddp",)  # the dense part; experts are expert-parallel whatever the strategy
WORLDS = (8, 64, 128, 256, 512, 1024)
CLUSTERS = ("dgx-a100", "dgx-h100")
CHECKPOINTING = {  # label: the option
    "none": False,
    "every block": True,
    "every 2nd block": 2,
    "every 4th block": 4,
    "every block, by operation": "op",
}
NODE = 8  # GPUs per node on both presets: hsdp shards inside a node
PANEL_CLASS = "toolkit-scale-explorer"  # the panel's CSS class (a browser test finds it by it)


def _config(model: str) -> dict:
    """The preset's configuration (its depth: n_layer)."""
    from ..models import presets

    return {
        "gpt3-175b": presets.GPT3,
        "zero-7.5b": presets.ZERO_7_5B,
        "gpt2-xl": presets.GPT2_XL,
        "moe-gpt-s": presets.MOE_GPT_S,
    }[MODELS.get(model, model)]


def scale_case(
    model: str = "GPT-3 175B",
    strategy: str = "fsdp",
    world_size: int = 512,
    cluster: str = "dgx-a100",
    activation_checkpointing: bool | int = False,
) -> dict:
    """The numbers for one choice: a `toolkit.sim.sweep` row of the whole model (its full depth); checkpointing
    every block (True), one block in k (k) or none (False)."""
    key = MODELS.get(model, model)
    if key not in PRESETS:
        raise ValueError(f"unknown model {model!r}; choose one of {list(MODELS)}.")
    moe = key.startswith("moe")
    valid = MOE_STRATEGIES if moe else STRATEGIES
    if strategy not in valid:
        raise ValueError(
            f"{model}: strategy {strategy!r} does not apply; choose one of {list(valid)}"
            + (" (its experts are expert-parallel; ddp trains its dense part)" if moe else "")
            + "."
        )
    options = {"activation_checkpointing": activation_checkpointing} if activation_checkpointing else {}
    spec = (
        ("fsdp", dict(options, sharding_group_size=min(NODE, world_size)))
        if strategy == "hsdp"
        else (strategy, options)
    )
    (row,) = sweep(
        PRESETS[key],
        layers=_config(key)["n_layer"],
        strategies={strategy: spec},
        worlds=(world_size,),
        cluster=cluster,
        mixed_precision=True,
    )
    return dict(row, model=model, cluster=cluster, activation_checkpointing=activation_checkpointing)


def case_text(row: dict) -> str:
    """The verdict and, when it fits, the step: what the panel prints under the figure."""
    flag = row["activation_checkpointing"]
    k = period(flag)
    which = {False: "", True: " with activation checkpointing", "op": " with activation checkpointing by operation"}
    which = which.get(flag, f" with one block in {k} checkpointed")
    head = (
        f"{row['model']} ({count_text(row['num_params'])} parameters, {row['layers']} layers), {row['label']}"
        f"{which}, rank 0 of {row['world_size']} on {row['cluster']}"
    )
    lines = [head, row["fit"].text()]
    if row["fits"]:
        b = row["breakdown"]
        lines.append(
            f"step {seconds_text(row['step_time'])} = compute {seconds_text(b['compute'])} + exposed "
            f"communication {seconds_text(b['exposed_comm'])} ({seconds_text(b['overlapped_comm'])} more "
            f"hidden behind compute): {row['tflops_per_gpu']:.3g} TFLOP/s per GPU, MFU {row['mfu']:.1%}"
        )
    lines.append(
        f"(model states {bytes_text(row['states'])} per GPU; simulated with {' and '.join(map(str, row['depths']))} "
        f"of the {row['layers']} layers and extrapolated: every "
        + (f"{k} layers add" if k > 1 else "layer adds")
        + " the same)"
    )
    return "\n".join(lines)


def case_figure(row: dict):
    """Memory at the peak, every category, against the GPU's memory."""
    fit = row["fit"]
    verdict = "fits" if fit.fits else "does not fit"
    return peak_bars(
        {f"{row['label']} x{row['world_size']}": row["peak_memory"]},
        capacity=fit.capacity,
        device=fit.device,
        title=f"{row['model']}, {row['label']}, rank 0 of {row['world_size']}: "
        f"{verdict} ({bytes_text(fit.peak)} at the peak)",
    )


class ScaleExplorer:
    """Dropdowns and a "simulate" button over an Output holding the figure and the verdict. Display
    it (last line of a cell). `row`, `figure` and `text` hold what is shown now; `redraws` counts the redraws."""

    def __init__(
        self,
        model: str = "GPT-3 175B",
        strategy: str = "fsdp",
        world_size: int = 512,
        cluster: str = "dgx-a100",
        activation_checkpointing: bool | int = False,
        *,
        run: bool = True,
    ):
        look = {"description_width": "120px"}
        self.model = widgets.Dropdown(options=list(MODELS), value=model, description="model", style=look)
        self.strategy = widgets.Dropdown(options=list(STRATEGIES), value=strategy, description="strategy", style=look)
        self.world_size = widgets.Dropdown(options=list(WORLDS), value=world_size, description="GPUs", style=look)
        self.cluster = widgets.Dropdown(options=list(CLUSTERS), value=cluster, description="cluster", style=look)
        self.checkpointing = widgets.Dropdown(
            options=list(CHECKPOINTING.items()),
            value=activation_checkpointing,
            description="checkpointing",
            style=look,
        )
        self.button = widgets.Button(description="simulate", button_style="primary")
        self.status = widgets.HTML()
        self.output = widgets.Output()
        self.row, self.figure, self.text, self.redraws = None, None, "", 0
        self.model.observe(self._offer, names="value")
        self.button.on_click(self.redraw)
        self.widget = widgets.VBox(
            [
                widgets.HBox(
                    [
                        widgets.VBox([self.model, self.strategy, self.world_size]),
                        widgets.VBox([self.cluster, self.checkpointing, widgets.HBox([self.button, self.status])]),
                    ]
                ),
                self.output,
            ]
        ).add_class(PANEL_CLASS)
        self._offer()
        if run:
            self.redraw()

    def _offer(self, _change=None) -> None:
        """Offer only what applies: ddp for an MoE model."""
        moe = MODELS[self.model.value].startswith("moe")
        valid = list(MOE_STRATEGIES if moe else STRATEGIES)
        if list(self.strategy.options) != valid:
            keep = self.strategy.value if self.strategy.value in valid else valid[0]
            self.strategy.options = valid
            self.strategy.value = keep

    def settings(self) -> dict:
        """scale_case's arguments for the current choices."""
        return {
            "model": self.model.value,
            "strategy": self.strategy.value,
            "world_size": self.world_size.value,
            "cluster": self.cluster.value,
            "activation_checkpointing": self.checkpointing.value,
        }

    def redraw(self, _button=None) -> None:
        """Simulate the current choices and redraw (the button calls it; callable directly too)."""
        chosen = self.settings()
        at = depths(_config(MODELS[chosen["model"]])["n_layer"], period(chosen["activation_checkpointing"]))
        self.button.disabled, self.status.value = True, f"<i>simulating {' and '.join(map(str, at))} layers ...</i>"
        try:
            self.row = scale_case(**chosen)
            self.figure, self.text = case_figure(self.row), case_text(self.row)
        except ValueError as exc:  # a choice that cannot work: say so, keep the panel
            self.row, self.figure, self.text = None, None, f"{exc}"
        finally:
            self.button.disabled, self.status.value = False, ""
        show(self.output, self.figure, self.text)
        self.redraws += 1

    def _repr_mimebundle_(self, **kwargs):  # shown as the widget when it ends a cell
        return self.widget._repr_mimebundle_(**kwargs)


def scale_explorer(**choices) -> ScaleExplorer:
    """The panel (see `ScaleExplorer`), drawn once for its defaults (GPT-3 175B, fsdp, 512 GPUs, DGX A100)."""
    return ScaleExplorer(**choices)
