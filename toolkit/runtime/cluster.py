"""ipyparallel MPI engines with torch.distributed ready, for notebooks that use `%%px` cells.

`toolkit.launch` runs one function on fresh ranks and returns; engines instead stay alive between
cells, so a lesson can build a model in one cell and step it in the next, on every rank at once:

    rc = toolkit.runtime.cluster(4)      # 4 MPI engines, default process group initialized
    %%px
    import torch, toolkit
    x = torch.ones(3); toolkit.comm.all_reduce(x); x
    ...
    rc.cluster.stop_cluster_sync()       # or: toolkit.runtime.cluster.stop(rc)

The engines are started with `mpiexec` (the one beside this Python if there is one, e.g. from the
mpich wheel), so each engine reads its rank from MPI, exactly as under `mpirun` on a cluster.
"""
from __future__ import annotations

import os
import shutil
import sys

_SETUP = "import toolkit, torch; _toolkit_place = toolkit.runtime.init({backend!r}, timeout_s={timeout_s})"


def _mpiexec() -> str:
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = beside if os.path.exists(beside) else shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("no `mpiexec` found: install an MPI (`pip install mpich mpi4py`, or load your "
                           "cluster's MPI module) so ipyparallel can start MPI engines.")
    return found


def cluster(n: int, *, backend: str = "auto", timeout_s: float = 120.0, activate: bool = True):
    """Start `n` MPI engines, initialize torch.distributed on each, return the connected ipyparallel Client.

    With `activate=True` the `%px`/`%%px` magics target all engines. Stop with `rc.cluster.stop_cluster_sync()`.
    """
    import ipyparallel as ipp

    if not isinstance(n, int) or n < 1:
        raise ValueError(f"cluster needs a positive number of engines, got {n!r}.")
    c = ipp.Cluster(engines="mpi", n=n)
    c.config.MPILauncher.mpi_cmd = [_mpiexec()]
    rc = c.start_and_connect_sync(activate=activate and _in_ipython())
    rc.wait_for_engines(n, timeout=timeout_s)
    view = rc[:]
    view.execute(_SETUP.format(backend=backend, timeout_s=timeout_s), block=True)
    return rc


def _in_ipython() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


def stop(rc) -> None:
    """Stop the engines and controller a `cluster()` call started."""
    rc.cluster.stop_cluster_sync()
