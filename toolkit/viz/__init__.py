"""Figures as pure functions of Runs and measurement records, and the panels built on them.

- `timeline(run)`: one lane per rank (communication above compute), spans coloured by operation,
  hover with bytes, duration and achieved bandwidth.
- `bandwidth(records_or_run)` / `collective_times(...)`: achieved algbw and busbw (or time) against message
  size per collective, backend versus hand-written, optionally with the alpha-beta model
  (`fit_alpha_beta` fits it).
- `ring_schedule(n)`: which chunk each rank sends at each step of a ring all-reduce.
- `collective_panel()`: pick an operation, a size and a world size, launch, redraw the timeline.
- `write_report(path, title, blocks)`: one self-contained HTML file of text, tables and figures.

Nothing here runs training; only the panel's button launches ranks (through a measuring function).
"""
from .bandwidth import bandwidth, collective_times, fit_alpha_beta
from .panels import CollectivePanel, collective_panel
from .report import heading, note, preformatted, report_html, table, write_report
from .ring import ring_schedule, ring_steps
from .timeline import timeline
from .explorer import MemoryExplorer, explorer_numbers, memory_explorer

__all__ = ["CollectivePanel", "bandwidth", "collective_panel", "collective_times", "fit_alpha_beta", "heading",
           "note", "preformatted", "report_html", "ring_schedule", "ring_steps", "table", "timeline", "write_report",
           "MemoryExplorer", "explorer_numbers", "memory_explorer"]
from .expert_load import expert_load

__all__ += ["expert_load"]
from .roofline import roofline, roofline_point

__all__ += ["roofline", "roofline_point"]
