"""Where processes come from: `launch` from a notebook or script, `init` under torchrun/mpirun, `cluster` for ipyparallel."""
from .cluster import cluster, stop as stop_cluster
from .env import Placement, detect, device, init, resolve_backend
from .launch import RankError, launch

__all__ = ["Placement", "RankError", "cluster", "detect", "device", "init", "launch", "resolve_backend",
           "stop_cluster"]
