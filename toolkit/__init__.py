"""Learn distributed training by running it: real collectives, recorded, measured and drawn.

The stable surface (see README): `launch`, `Run`, and the subpackages `runtime`, `comm`, `trace`,
`memory`, `parallel`, `moe`, `viz`.
"""
from . import comm, runtime, trace
from .run import Run
from .runtime import launch

__all__ = ["Run", "comm", "launch", "runtime", "trace"]
