"""Figures as pure functions of Runs and measurement records, and the panels built on them.

- `style`: one colour per meaning for every figure (forward, backward, optimizer, wait, each collective,
  each memory category; colour-blind safe), and titles placed below plotly's toolbar.
- `timeline(run)`: one lane per rank (communication above compute), spans coloured by operation,
  hover with bytes, duration and achieved bandwidth.
- `bandwidth(records_or_run)` / `collective_times(...)`: achieved algbw and busbw (or time) against message
  size per collective, backend versus hand-written, optionally with the alpha-beta model
  (`fit_alpha_beta` fits it).
- `ring_schedule(n)`: which chunk each rank sends at each step of a ring all-reduce.
- `collective_panel()`: pick an operation, a size and a world size, launch, redraw the timeline.
- `write_report(path, title, blocks)`: one self-contained HTML file of text, tables and figures.
- `memory_bars(runs, predicted)` / `comm_bars(rows)` / `model_states_bars(...)` / `memory_over_time(run)`:
  measured memory and bytes against the formulas; memory through a step with FSDP's gathers and frees;
  `peak_bars(peaks, capacity=...)`: a simulated rank's memory at its peak, every category, against the device.
- `memory_explorer()` (ZeRO stages, Figure 1) and `wrap_policy_explorer()` (FSDP units): widgets on the theory.
- `expert_load(run)`: experts x iterations heatmap, dropped tokens, imbalance; `roofline(runs)`: the DDL-roofline.
- `pipeline_timeline(run)`: a pipeline's step, ranks x time, one block per action coloured by micro-batch,
  arrows for the activations and gradients between stages, the bubble measured (and the formula).
- `scaling(rows)`: a simulated sweep's TFLOP/s per GPU over the number of GPUs, hollow where it does not fit
  (`scale_explorer.scale_explorer()`, lesson 07's panel, imports the simulator: not loaded here).

Nothing here runs training; only the panel's button launches ranks (through a measuring function).
"""

from . import style
from .bandwidth import bandwidth, collective_times, fit_alpha_beta
from .expert_load import expert_load
from .explorer import MemoryExplorer, explorer_numbers, memory_explorer
from .fsdp_explorer import WrapPolicyExplorer, policy_numbers, wrap_policy_explorer
from .memory import comm_bars, memory_bars, memory_over_time, model_states_bars, peak_bars
from .panels import CollectivePanel, collective_panel
from .pipeline import pipeline_timeline
from .report import bullets, heading, note, preformatted, report_html, table, write_report
from .ring import ring_schedule, ring_steps
from .roofline import roofline, roofline_point
from .scaling import scaling
from .timeline import timeline

__all__ = [
    "style",
    "CollectivePanel",
    "MemoryExplorer",
    "WrapPolicyExplorer",
    "bandwidth",
    "bullets",
    "collective_panel",
    "collective_times",
    "comm_bars",
    "expert_load",
    "explorer_numbers",
    "fit_alpha_beta",
    "heading",
    "memory_bars",
    "memory_explorer",
    "memory_over_time",
    "model_states_bars",
    "note",
    "peak_bars",
    "pipeline_timeline",
    "policy_numbers",
    "preformatted",
    "report_html",
    "ring_schedule",
    "ring_steps",
    "roofline",
    "roofline_point",
    "scaling",
    "table",
    "timeline",
    "wrap_policy_explorer",
    "write_report",
]
