"""Where processes come from: `launch` from a notebook or script, `init` under torchrun/mpirun, `cluster` for ipyparallel."""
from .env import Placement, detect, device, init, resolve_backend
from .launch import RankError, launch

__all__ = ["Placement", "RankError", "cluster", "detect", "device", "init", "launch", "resolve_backend"]


def cluster(n: int, **kwargs):
    """Start `n` ipyparallel MPI engines with torch.distributed ready (see toolkit.runtime.cluster)."""
    from .cluster import cluster as _cluster

    return _cluster(n, **kwargs)
