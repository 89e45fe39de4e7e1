"""A simulated cluster inside the caller's process: one rank of a fake process group, computing on "meta".

    with cluster(world_size=512, rank=0):
        ...  # toolkit.parallel.wrap and a training step run here exactly as on a real rank

Inside, the default process group is torch's fake one (`fake.py`) and `toolkit.runtime.env.device()`
is the meta device, so the strategies build their flat buffers, shards and gathered copies as meta
tensors: every size is real, nothing is allocated. Attention takes the fused kernel a real device
would (`attention.py`). An emulated link (`toolkit.comm.emulate`) stays in force as a setting, so an
MoE layer decides by it as on a real rank, but no fake collective books it or waits for it: the cost
model prices them on the cluster's links (`calibrate.from_measurements(..., link)` for the emulated one).
On the way out, even after an error, the group is
destroyed and every per-process cache that remembers groups or the backend is cleared, so a later
simulation, or a real `toolkit.launch`, starts clean. This process's trace recorder is set aside and
given back, so a simulation leaves no spans in it, and so is `sys.excepthook` (torch's process group
wraps it to prefix tracebacks with the rank, once more per group).
"""

from __future__ import annotations

import contextlib
import sys

import torch.distributed as dist

from ..comm.emulate import no_links
from ..runtime import env
from ..trace.events import recorder
from . import fake
from .attention import fused_attention

MAX_WORLD_SIZE = fake.MAX_WORLD_SIZE


def check(world_size, rank=0, ranks_per_node=8) -> int:
    """Validate the cluster's shape; return the ranks per node (all of them when the world is one node)."""
    for name, value in (("world_size", world_size), ("rank", rank), ("ranks_per_node", ranks_per_node)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}.")
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size={world_size}: the simulated cluster holds 1 to {MAX_WORLD_SIZE} ranks.")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is not a rank of a world of {world_size}: choose 0..{world_size - 1}.")
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}.")
    if world_size <= ranks_per_node:
        return world_size  # one node holds the whole world
    if world_size % ranks_per_node:
        below = world_size - world_size % ranks_per_node
        raise ValueError(
            f"world_size={world_size} is not a whole number of nodes of ranks_per_node={ranks_per_node}; "
            f"use a multiple of {ranks_per_node} (e.g. {below} or {below + ranks_per_node}) or "
            f"another ranks_per_node."
        )
    return ranks_per_node


def forget_groups() -> None:
    """Clear what this process remembers about process groups and the backend (not the groups themselves)."""
    from ..comm import collectives
    from ..moe import machine
    from ..parallel import fsdp_unit

    collectives._ranks_cache.clear()
    fsdp_unit._GROUPS.clear()
    machine._cache.clear()  # measured machine rates: meaningless on a fake group, stale after it
    recorder._cuda = None  # "am I on a GPU" is decided again by the next process group


@contextlib.contextmanager
def cluster(world_size: int, rank: int = 0):
    """This process as rank `rank` of a simulated `world_size`-rank cluster, for the duration of the block."""
    check(world_size, rank, ranks_per_node=world_size)
    if dist.is_initialized():
        raise RuntimeError(
            f"a process group ({dist.get_backend()}, {dist.get_world_size()} ranks) is already initialized in "
            f"this process; a simulation makes its own fake one. Simulate outside toolkit.launch's ranks (in the "
            f"notebook or script itself), or call torch.distributed.destroy_process_group() first."
        )
    saved, hook = dict(recorder.__dict__), sys.excepthook
    forget_groups()
    try:
        fake.init(world_size, rank)  # torch chains a "[rank0]:" excepthook onto sys.excepthook here
        recorder.reset()
        # attention as a real rank runs it (attention.py); an emulated link is a setting here, never booked
        # (comm/emulate.py); an all-to-all's values as every rank alike would send them (fake.py)
        with env.computing_on("meta"), fused_attention(), no_links(), fake.alike_all_to_all():
            yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        forget_groups()
        recorder.__dict__.update(saved)
        sys.excepthook = hook  # else every later traceback in this process carries one prefix per simulation
