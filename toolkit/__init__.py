"""Learn distributed training by running it: real collectives, recorded, measured and drawn.

The stable surface (see README and DESIGN): `launch`, `Run`, `parallel.wrap` / `parallel.full_state_dict`,
`memory.model_states` / `memory.ledger`, `moe.MoE`, `train.TrainConfig` / `train.launch_train`, and the
figures in `viz`, the simulated cluster in `sim` (both imported on first use: ranks never pay for them).
"""

import importlib

from . import comm, memory, models, moe, parallel, runtime, trace
from .run import Run
from .runtime import launch

__all__ = ["Run", "comm", "launch", "memory", "models", "moe", "parallel", "runtime", "sim", "trace", "train", "viz"]


def __getattr__(name):
    if name in ("viz", "train", "grading", "compare", "demo", "sim"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'toolkit' has no attribute {name!r}")
