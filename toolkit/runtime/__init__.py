"""Where processes come from: `launch` from a notebook or script, `init` under torchrun/mpirun, `cluster` for
ipyparallel."""

from .cluster import cluster, restart_cluster
from .cluster import stop as stop_cluster
from .cluster_explain import explain as explain_cluster_error
from .env import Placement, detect, device, init, resolve_backend
from .launch import RankError, launch

__all__ = [
    "Placement",
    "RankError",
    "cluster",
    "detect",
    "device",
    "explain_cluster_error",
    "init",
    "launch",
    "resolve_backend",
    "restart_cluster",
    "stop_cluster",
]
