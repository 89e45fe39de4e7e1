"""Memory, and the bytes each rank sends, against the theory: figures of a Run, a Simulation or the formulas alone.

- `bars.py`: measured against the formulas, one bar per strategy (and rank): `memory_bars` (the peak of each
  category; diamonds: the formula's model states), `comm_bars` (bytes sent per step against theory) and
  `model_states_bars` (the theory alone, under DP and ZeRO 1, 2, 3);
- `peak.py`: `peak_bars`, what a simulated rank holds at its peak moment, every category, against the device;
- `over_time.py`: `memory_over_time`, memory per category through the steps, FSDP's gathers and frees marked.
"""

from .bars import CATEGORIES, comm_bars, memory_bars, model_states_bars, peak_by_category
from .over_time import memory_over_time
from .peak import peak_bars

__all__ = [
    "CATEGORIES",
    "comm_bars",
    "memory_bars",
    "memory_over_time",
    "model_states_bars",
    "peak_bars",
    "peak_by_category",
]
