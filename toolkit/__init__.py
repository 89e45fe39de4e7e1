"""Learn distributed training by running it: real collectives, recorded, measured and drawn."""
from . import comm, runtime, trace
from .runtime import launch

__all__ = ["comm", "launch", "runtime", "trace"]
