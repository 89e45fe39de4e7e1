"""The layout of a world as dp x pp x tp: a torch `DeviceMesh` with the dimension names ("dp", "pp", "tp").

    mesh = toolkit.parallel.mesh.build(tp=2, pp=2)      # world 8 -> dp 2 x pp 2 x tp 2
    mesh["tp"].get_group(), mesh.get_coordinate()       # this rank's tensor-parallel group, (dp, pp, tp) index

Why this order: the last dimension varies fastest, so the ranks of one tensor-parallel group are consecutive
global ranks (0-1, 2-3, ...). Tensor parallelism talks twice per layer on the critical path, so its group must
sit inside one node, on NVLink; pipeline stages talk once per micro-batch (point to point); data parallelism
talks once per step and hides behind backward, so it may span nodes. Megatron-LM, torchtitan and picotron
order their grids the same way.

Sizes of 1 are allowed (a dimension of one rank is a group of one), so every wrapped model can carry the
same three-name mesh, and `group(mesh, "dp")` is what a data-parallel strategy reduces over. The mesh is
torch's own, so FSDP2/DTensor/torchtitan's conventions carry over; the collectives still go through
`toolkit.comm` with these groups, so every one is recorded with its group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

DIMS = ("dp", "pp", "tp")


@dataclass(frozen=True)
class Layout:
    """The sizes of the three dimensions; dp * pp * tp is the world size."""

    dp: int = 1
    pp: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def coordinate(self, rank: int) -> tuple[int, int, int]:
        """(dp, pp, tp) index of a global rank: tp varies fastest, dp slowest."""
        return rank // (self.pp * self.tp), rank // self.tp % self.pp, rank % self.tp

    def rank(self, dp: int, pp: int, tp: int) -> int:
        """The global rank at a (dp, pp, tp) index."""
        return (dp * self.pp + pp) * self.tp + tp

    def __str__(self) -> str:
        return f"dp {self.dp} x pp {self.pp} x tp {self.tp}"


def layout(world_size: int, *, tp: int = 1, pp: int = 1) -> Layout:
    """The layout of `world_size` ranks with `tp` and `pp` given; dp is what is left. Checks every size."""
    for name, value in (("tp", tp), ("pp", pp), ("world size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
    if world_size % (tp * pp):
        fits = [t for t in range(1, world_size + 1) if world_size % (t * pp) == 0]
        raise ValueError(f"a world of {world_size} ranks does not split into pp={pp} x tp={tp} = {tp * pp} ranks "
                         f"per data-parallel replica; the world must be a multiple of pp x tp (with pp={pp}, "
                         f"tp can be one of {fits}), or launch a world of {tp * pp * max(1, world_size // (tp * pp))}.")
    return Layout(dp=world_size // (tp * pp), pp=pp, tp=tp)


def build(*, tp: int = 1, pp: int = 1):
    """The ("dp", "pp", "tp") `DeviceMesh` over every rank of the default process group."""
    from torch.distributed.device_mesh import init_device_mesh

    from ..runtime import env

    if not dist.is_initialized():
        raise RuntimeError("a dp x pp x tp layout spans ranks, so it needs torch.distributed initialized: run it "
                           "inside toolkit.launch(fn, world_size), or in toolkit.sim.simulate.")
    shape = layout(dist.get_world_size(), tp=tp, pp=pp)
    device_type = env.device().type
    device_type = "cpu" if device_type == "meta" else device_type  # the simulator computes on meta
    return init_device_mesh(device_type, (shape.dp, shape.pp, shape.tp), mesh_dim_names=DIMS)


def group(mesh, dim: str):
    """The process group of this rank along `dim` ("dp", "pp" or "tp")."""
    if dim not in DIMS:
        raise ValueError(f"unknown mesh dimension {dim!r}; choose one of {DIMS}.")
    return mesh[dim].get_group()


def layout_of(mesh) -> Layout:
    """The sizes of a ("dp", "pp", "tp") mesh."""
    return Layout(*(mesh.size(mesh.mesh_dim_names.index(d)) for d in DIMS))
