"""Where this process sits in the job, whoever started it.

torchrun, mpirun (OpenMPI or MPICH/PMI), SLURM's srun, ipyparallel MPI engines and `toolkit.launch`
each describe rank, world size and local rank with their own environment variables. `init()` reads
whichever is present, picks the backend and device, and initializes the default process group, so
the same script runs under all of them. Under mpirun/srun/torchrun it also makes the rank that caused a
failure the one a person reads about (`abort.py`, `peers.py`).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import abort, peers

BACKENDS = ("auto", "gloo", "nccl")

# (rank, world size, local rank) variable names, in the order they are tried.
_LAUNCHERS = {
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
}


# ranks on this node, by launcher: how many GPUs 'auto' needs before it picks NCCL
_LOCAL_SIZES = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")


@dataclass(frozen=True)
class Placement:
    """Rank, world size and local rank of this process, and who told us."""

    rank: int
    world_size: int
    local_rank: int
    launcher: str


def detect(environ=None) -> Placement:
    """Read the placement from the environment; a lone process is rank 0 of 1."""
    environ = os.environ if environ is None else environ
    for launcher, (rank_var, world_var, local_var) in _LAUNCHERS.items():
        if rank_var in environ and world_var in environ:
            rank, world = int(environ[rank_var]), int(environ[world_var])
            local = int(environ.get(local_var, rank))
            return Placement(rank, world, local, launcher)
    return Placement(0, 1, 0, "single")


def resolve_backend(backend: str = "auto", local_world_size: int = 1) -> str:
    """'auto' is NCCL when every local rank can have its own GPU, gloo otherwise."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not known; choose one of {BACKENDS}.")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if gpus >= local_world_size and dist.is_nccl_available() else "gloo"
    if backend == "nccl" and gpus < local_world_size:
        raise ValueError(
            f"backend='nccl' needs one GPU per local rank: {local_world_size} local ranks but "
            f"{gpus} GPU(s) visible. Use backend='gloo' (CPU) or backend='auto'."
        )
    return backend


_device: torch.device | None = None  # set by `computing_on` (a simulated cluster computes on "meta")


@contextlib.contextmanager
def computing_on(where):
    """Inside, `device()` is `where`: toolkit.sim runs a rank's strategy code on the "meta" device."""
    global _device
    before, _device = _device, torch.device(where)
    try:
        yield _device
    finally:
        _device = before


def default_world_size() -> int:
    """Ranks for a demo or a comparison: one per GPU on a CUDA machine; otherwise 4.

    Why 4 on a CPU: it is the smallest ring where the pattern shows (every rank has a distinct left and
    right neighbour, and 2(N-1)/N = 1.5 is visibly between 1 and 2), and gloo runs 4 ranks on any
    laptop. With fewer cores than ranks the ranks take turns on the cores, so every time measured is
    a lower bound on the algorithm's speed (an upper bound on its time), not a property of the network.
    """
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.cuda.device_count()
    return 4


def device() -> torch.device:
    """The device this rank computes on: its own GPU under NCCL, the CPU under gloo (or `computing_on`'s).

    TOOLKIT_DEVICE=cuda puts gloo ranks on the GPU too (bench/gpu_suite.py: world 2 on one GPU, where NCCL
    cannot give two ranks one device)."""
    if _device is not None:
        return _device
    if os.environ.get("TOOLKIT_DEVICE") == "cuda":  # gloo on CUDA tensors: two ranks sharing one GPU
        return torch.device("cuda", torch.cuda.current_device())
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def mpi_store(world_size: int, timeout) -> dist.TCPStore:
    """The rendezvous store under MPI (mpirun, srun, ipyparallel's MPI engines), where nobody sets MASTER_ADDR
    and MASTER_PORT: rank 0 hosts it on a port the OS gives it (bound from that moment, so no other process
    can take it, as it could a port picked, released and bound later), and MPI tells the others where it is."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    store = (
        dist.TCPStore(socket.gethostname(), 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        if rank == 0
        else None
    )
    host, port = comm.bcast((socket.gethostname(), store.port) if rank == 0 else None, root=0)
    return store if rank == 0 else dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)


def init(backend: str = "auto", *, timeout_s: float = 300.0) -> Placement:
    """Initialize the default process group from whatever launched us; safe to call twice."""
    place = detect()
    if dist.is_initialized():
        return place
    local_world = next((int(os.environ[v]) for v in _LOCAL_SIZES if v in os.environ), 1)
    backend = resolve_backend(backend, max(local_world, place.local_rank + 1))
    if backend == "nccl":
        torch.cuda.set_device(place.local_rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = None
    if "TOOLKIT_STORE_PORT" in os.environ:  # toolkit.launch hosts the rendezvous store itself
        store = dist.TCPStore(
            "127.0.0.1",
            int(os.environ["TOOLKIT_STORE_PORT"]),
            place.world_size,
            is_master=False,
            timeout=timeout,
        )
    elif place.launcher in ("openmpi", "mpich", "slurm") and not {"MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys():
        store = mpi_store(place.world_size, timeout)
    elif place.world_size == 1 and "MASTER_PORT" not in os.environ:
        store = dist.HashStore()  # a lone process meets nobody: no port to take (29500 may be someone's)
    if store is None:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(
        backend,
        store=store,
        rank=place.rank,
        world_size=place.world_size,
        timeout=timeout,
        init_method=None if store is not None else "env://",
    )
    atexit.register(_shutdown)  # a script that never tears down must not abort at exit (gloo's threads)
    outside = place.launcher in ("openmpi", "mpich", "slurm") or "TORCHELASTIC_RUN_ID" in os.environ  # not launch
    if outside and place.world_size > 1:
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else place.launcher
        known = peers.exchange(dist.distributed_c10d._get_default_store(), place.rank, place.world_size, launcher)
        abort.install(place.rank, launcher, known)  # the cause is what one reads (after torch's hook)
    return place


def _shutdown() -> None:
    peers.mark(peers.known, dist.get_rank() if dist.is_initialized() else 0, "ended")  # before its sockets close
    if dist.is_initialized():
        dist.destroy_process_group()
