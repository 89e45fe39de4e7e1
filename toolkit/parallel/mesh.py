"""The layout of a world as dp x pp x cp x tp: a torch `DeviceMesh` with the dimension names ("dp", "pp", "cp", "tp").

    mesh = toolkit.parallel.mesh.build(tp=2, pp=2)      # world 8 -> dp 2 x pp 2 x tp 2, Megatron's rank order
    mesh["tp"].get_group(), coordinate(mesh)           # this rank's tensor-parallel group, its (dp, pp, cp, tp) index
    layout(8, tp=2, pp=2).groups("dp")                 # [[0, 2], [1, 3], [4, 6], [5, 7]]: which global ranks

Two things are separate here: the *names* of the dimensions, always ("dp", "pp", "cp", "tp") in that order (so
code reads a group or a coordinate by name and never depends on the rank order), and the *rank order*: which
global ranks each group holds. The order says how the dimensions nest, innermost first, in Megatron-LM's own
spelling (`parallel_state.initialize_model_parallel(order=...)`):

    "tp-cp-ep-dp-pp"  (the default, Megatron-core's): tp varies fastest, then cp, then dp; pp is outermost
    "tp-cp-pp-dp"     this toolkit's order before: dp outermost

Why Megatron's default: the last dimension to vary is the one that talks least. Tensor parallelism talks twice
per layer on the critical path, so its ranks are consecutive (0-1, 2-3, ...: one node, NVLink); context
parallelism passes keys and values every layer, next; data parallelism talks once per step, hidden behind
backward; pipeline stages exchange one activation per micro-batch, point to point, the least, so a pipeline's
stages are the ranks farthest apart (different nodes, or pods). torchtitan's mesh is ("pp", "dp_replicate",
"dp_shard", "cp", "tp"), outermost first: the same nesting. Llama 3's 4D layout is [tp, cp, pp, dp] from
innermost (dp outermost: "tp-cp-pp-dp" here); picotron's grid is (dp, pp, cp, tp), dp outermost, too.
("ep" is accepted where Megatron writes it and takes no ranks of its own here: an MoE layer's experts are split
over the group it is given, `toolkit.moe.MoE(group=...)`.)

Expert parallelism is carved out of the ranks of a pipeline stage, as Megatron-core carves it (its expert rank
generator: the same order, cp folded in, "ep" next to the innermost dimensions): list a stage's dp x cp x tp
ranks innermost dimension first (tp fastest, then cp, then dp, in the order's nesting); each run of `ep`
consecutive ranks of that list is an expert-parallel group, and the ranks at the same place of every run form an
expert-data-parallel group, which holds copies of the same experts. `layout.expert_groups(ep)`; with cp these
groups mix cp and dp ranks (dp 2 x cp 2, ep 2: the experts split over each cp pair, copied over dp), since
routing is per token and every cp rank routes its own tokens. (The toolkit's tp ranks share out their tokens
to the experts, `tensor/moe.py`, so they join the list as Megatron's expert-tensor-parallel size 1 would.)

Sizes of 1 are allowed (a dimension of one rank is a group of one), so every wrapped model carries the same
four-name mesh, and `group(mesh, "dp", "cp")` is what a data-parallel strategy reduces over (the cp ranks hold
the same parameters and see different tokens, as dp ranks do: torchtitan's FSDP shards over dp x cp). The mesh
is torch's own, so FSDP2/DTensor/torchtitan's conventions carry over; the collectives still go through
`toolkit.comm` with these groups, so every one is recorded with its global ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

DIMS = ("dp", "pp", "cp", "tp")  # the names, in the order coordinates are given (not the rank order)
ORDER = "tp-cp-ep-dp-pp"  # Megatron-core's default rank order, innermost first
DP_OUTERMOST = "tp-cp-pp-dp"  # dp outermost: Llama 3's and picotron's nesting, and this toolkit's before


class Coordinate(NamedTuple):
    """A rank's index along each dimension."""

    dp: int
    pp: int
    cp: int
    tp: int


def nesting(order: str = ORDER) -> tuple[str, ...]:
    """The four dimensions from innermost (varies fastest) to outermost, from Megatron's spelling of an order."""
    if not isinstance(order, str):
        raise ValueError(
            f"order must be a string of dimension names from innermost to outermost, as Megatron-LM "
            f"writes it (e.g. {ORDER!r}), got {order!r}."
        )
    names = [n for n in order.split("-") if n != "ep"]
    if sorted(names) != sorted(DIMS):
        raise ValueError(
            f"order={order!r} must name each of {DIMS} once, innermost first, joined by '-' (Megatron's "
            f"spelling; 'ep' may appear and takes no ranks): e.g. {ORDER!r} (Megatron's default, pp "
            f"outermost) or {DP_OUTERMOST!r} (dp outermost)."
        )
    return tuple(names)


@dataclass(frozen=True)
class Layout:
    """The sizes of the four dimensions and the order they nest in; dp * pp * cp * tp is the world size."""

    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    order: str = ORDER

    def __post_init__(self):
        nesting(self.order)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    def size(self, dim: str) -> int:
        return getattr(self, _known(dim))

    def coordinate(self, rank: int) -> Coordinate:
        """The (dp, pp, cp, tp) index of a global rank: the innermost dimension of the order varies fastest."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a world of {self.world_size} ranks ({self}).")
        index = {}
        for dim in nesting(self.order):
            rank, index[dim] = divmod(rank, self.size(dim))
        return Coordinate(**index)

    def rank(self, *, dp: int = 0, pp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """The global rank at a (dp, pp, cp, tp) index."""
        index, rank = dict(dp=dp, pp=pp, cp=cp, tp=tp), 0
        for dim in reversed(nesting(self.order)):
            rank = rank * self.size(dim) + index[dim]
        return rank

    def grid(self) -> torch.Tensor:
        """The global ranks as a (dp, pp, cp, tp) tensor: entry [d, p, c, t] is the rank at that index (on the CPU,
        also where the simulator builds a model on meta)."""
        inner_first = nesting(self.order)
        outer_first = inner_first[::-1]
        ranks = torch.arange(self.world_size, device="cpu").reshape([self.size(d) for d in outer_first])
        return ranks.permute([outer_first.index(d) for d in DIMS])

    def groups(self, *dims: str) -> list[list[int]]:
        """Every group along `dims` (one name, or several flattened: `groups("dp", "cp")`), each a list of global
        ranks in the order of their index along `dims` (the first name slowest); groups ordered by the lowest rank."""
        if not dims:
            raise ValueError(f"groups() needs at least one dimension name, from {DIMS}.")
        keep = [DIMS.index(_known(d)) for d in dims]
        rest = [i for i in range(len(DIMS)) if i not in keep]
        moved = self.grid().permute(rest + keep).reshape(-1, math.prod(self.size(d) for d in dims))
        return sorted(moved.tolist(), key=min)

    def group_of(self, rank: int, *dims: str) -> list[int]:
        """The global ranks of `rank`'s group along `dims`."""
        return next(g for g in self.groups(*dims) if rank in g)

    def expert_groups(self, ep: int) -> tuple[list[list[int]], list[list[int]]]:
        """(expert-parallel groups of `ep` ranks, expert-data-parallel groups): Megatron-core's carving of each
        pipeline stage's dp x cp x tp ranks (see the module's text), every group a list of global ranks."""
        stage = self.world_size // self.pp
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or stage % ep:
            fits = [e for e in range(1, stage + 1) if stage % e == 0]
            raise ValueError(
                f"ep={ep!r}: expert parallelism is carved out of the dp x cp x tp = {stage} ranks of a pipeline "
                f"stage ({self}), so ep must divide {stage}: one of {fits}."
            )
        inner = [d for d in reversed(nesting(self.order)) if d != "pp"]  # outermost first: the last varies fastest
        grid = self.grid().permute([DIMS.index("pp")] + [DIMS.index(d) for d in inner])
        runs = grid.reshape(self.pp, stage // ep, ep)
        return runs.reshape(-1, ep).tolist(), runs.transpose(1, 2).reshape(-1, stage // ep).tolist()

    def __str__(self) -> str:
        sizes = " x ".join(f"{d} {self.size(d)}" for d in DIMS if d != "cp" or self.cp > 1)
        return sizes if self.order == ORDER else f"{sizes} (order {self.order})"


def layout(world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1, order: str = ORDER) -> Layout:
    """The layout of `world_size` ranks with `tp`, `pp` and `cp` given; dp is what is left. Checks every size."""
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("world size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
    nesting(order)
    per_replica = tp * pp * cp
    if world_size % per_replica:
        others = f"pp={pp}" + (f", cp={cp}" if cp > 1 else "")
        fits = [t for t in range(1, world_size + 1) if world_size % (t * pp * cp) == 0]
        named = f"pp={pp} x " + (f"cp={cp} x " if cp > 1 else "") + f"tp={tp}"
        choice = (
            f"with {others}, tp can be one of {fits}"
            if fits
            else f"with {others} no tp can: {others.replace(', ', ' x ')} does not divide {world_size}"
        )
        raise ValueError(
            f"a world of {world_size} ranks does not split into {named} = {per_replica} ranks "
            f"per data-parallel replica; the world must be a multiple of that ({choice}), or launch "
            f"a world of {per_replica * max(1, world_size // per_replica)}."
        )
    return Layout(dp=world_size // per_replica, pp=pp, cp=cp, tp=tp, order=order)


def build(*, tp: int = 1, pp: int = 1, cp: int = 1, order: str = ORDER):
    """The ("dp", "pp", "cp", "tp") `DeviceMesh` over every rank of the default process group, its ranks laid out
    in `order`."""
    from torch.distributed.device_mesh import DeviceMesh

    from ..runtime import env

    if not dist.is_initialized():
        raise RuntimeError(
            "a dp x pp x cp x tp layout spans ranks, so it needs torch.distributed initialized: run "
            "it inside toolkit.launch(fn, world_size), or in toolkit.sim.simulate."
        )
    shape = layout(dist.get_world_size(), tp=tp, pp=pp, cp=cp, order=order)
    device_type = env.device().type
    device_type = "cpu" if device_type == "meta" else device_type  # the simulator computes on meta
    mesh = DeviceMesh(device_type, shape.grid(), mesh_dim_names=DIMS)
    mesh.order = order
    return mesh


def group(mesh, *dims: str):
    """The process group of this rank along `dims`: one ("dp", "pp", "cp" or "tp"), or several flattened into one
    group (`group(mesh, "dp", "cp")`: every rank that holds the same parameters, which a data-parallel strategy
    reduces over). A flattened group whose other dimensions are all of size 1 is that dimension's own group."""
    for dim in dims:
        _known(dim)
    wide = [d for d in dims if mesh.size(DIMS.index(d)) > 1]
    if len(dims) == 1 or len(wide) <= 1:
        return mesh[wide[0] if wide else dims[0]].get_group()
    name = "_".join(dims)
    return mesh[tuple(dims)]._flatten(name).get_group()


def coordinate(mesh) -> Coordinate:
    """This rank's (dp, pp, cp, tp) index on `mesh`."""
    return Coordinate(*mesh.get_coordinate())


def data_parallel_rank(mesh) -> int:
    """This rank's index in the group a data-parallel strategy reduces over (`group(mesh, "dp", "cp")`)."""
    c, cp = coordinate(mesh), mesh.size(DIMS.index("cp"))
    return c.dp * cp + c.cp


def own_group(groups: list[list[int]]):
    """A process group for each of `groups` (every rank makes every one, in the same order: torch's rule); this
    rank's (None if it is in none)."""
    found = None
    for ranks in groups:
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            found = group
    return found


def expert_group(ep: int, *, tp: int = 1, pp: int = 1, cp: int = 1, order: str = ORDER):
    """This rank's expert-parallel group of `ep` ranks in the world's dp x pp x cp x tp layout (`Layout.expert_groups`):
    what an MoE model is built over before it is wrapped with the same tp, pp, cp and ep
    (`moe_gpt(group=expert_group(2, cp=2))`; TrainConfig's moe_model_fn does it from `options["ep"]`)."""
    shape = layout(dist.get_world_size(), tp=tp, pp=pp, cp=cp, order=order)
    return own_group(shape.expert_groups(ep)[0])


def layout_of(mesh) -> Layout:
    """The sizes and the rank order of a ("dp", "pp", "cp", "tp") mesh."""
    return Layout(*(mesh.size(DIMS.index(d)) for d in DIMS), order=getattr(mesh, "order", ORDER))


def _known(dim: str) -> str:
    if dim not in DIMS:
        raise ValueError(f"unknown mesh dimension {dim!r}; choose one of {DIMS}.")
    return dim
