"""One FSDP unit: a flat parameter, sharded, that can be gathered whole and freed again.

A unit owns the parameters of one module (see `fsdp_policy.py`), laid end to end in one flat
parameter padded to a multiple of the sharding factor F (`flat.py`). Between uses a rank keeps only
its 1/F slice, in fp32: that slice is also the master weight the optimizer steps. While the module
computes, its own Parameters are *views* of the flat buffer, so the module's code runs unchanged; only
the buffer's memory comes and goes:

    SHARDED  --unshard()-->  GATHERING  --wait_unshard()-->  GATHERED  --reshard()-->  SHARDED
    (buffer: 0 bytes)        (all-gather in flight)          (buffer: the full values)

Between uses the Parameters are this rank's pieces of the master (`flat.ParamViews`, as FSDP1's
`use_orig_params`): FSDP points them at the full views once a unit is gathered and back after
`reshard()`, so reading `module.weight` between steps reads memory that exists.

and during backward, the gradients take the reverse road:

    add_grad(p) for every parameter  ->  flatten_grads(): into one flat gradient  ->
    reduce_grad(): reduce-scatter the flat gradient, rank r
    receiving the average of slice r  ->  finish_reduce(): wait; with hybrid sharding all-reduce that
    slice across the replicas; add it into the fp32 gradient of the shard

Those six methods are the unit's whole job. *When* they are called (hooks, prefetching, the end
of backward) is `fsdp.py`'s job: a lab can re-implement `unshard` and `reshard` alone and plug them in.

Why one flat parameter per unit (FSDP1, and the FSDP paper) rather than FSDP2's per-parameter dim-0
shards: one all-gather and one reduce-scatter per unit on one contiguous buffer is the simplest picture
of "a unit", the padding is at most F-1 elements per unit, and the shards reuse the `FlatBuffer` ZeRO
already uses. The price: a rank's slice cuts through tensors anywhere, so a rank does not hold whole
rows of any weight (FSDP2's dim-0 shards are real `DTensor`s that keep shapes and let an optimizer or a
checkpoint see each parameter's rows); and only elementwise optimizers can step the slices
(`sharded_optimizer.py`'s allow-list). FSDP2 also copies into and out of a flat buffer around each collective;
here the flat buffer *is* the storage, so there is no copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from ..runtime import env
from .flat import FlatBuffer, ParamViews
from .fsdp_init import materialize
from .local import compute_dtype
from .sharded import Shard

SHARDED, GATHERING, GATHERED = "sharded", "gathering", "gathered"


class Sharding:
    """Who holds the shards, and in which dtypes the unit computes and communicates.

    shard_group:   the F ranks over which every unit is sharded (F = the sharding factor; all ranks
                   for full sharding). `size` = F, `rank` = this rank's index in it.
    replica_group: with hybrid sharding (HSDP), the ranks that hold the same shard in the other
                   shard groups; gradients are averaged over them after the reduce-scatter. None otherwise.
    param_dtype:   the dtype of the gathered parameters (compute and all-gather); reduce_dtype: of the
                   gradient reduction. Masters, gradient shards and optimizer states are fp32.
    """

    def __init__(self, shard_group=None, replica_group=None, param_dtype=torch.float32, reduce_dtype=torch.float32):
        self.shard_group, self.replica_group = shard_group, replica_group
        ranks = comm.group_ranks(shard_group)
        self.size, self.rank = len(ranks), ranks.index(dist.get_rank())
        self.replicas = len(comm.group_ranks(replica_group)) if replica_group is not None else 1
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.device = env.device()


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes of the gathered parameters (compute, all-gather) and of the gradient reduction.
    reduce_dtype=None means the same as param_dtype; torch.float32 reduces 16-bit gradients in fp32."""

    param_dtype: torch.dtype | str = torch.bfloat16
    reduce_dtype: torch.dtype | str | None = None


def dtypes(mixed_precision) -> tuple[torch.dtype, torch.dtype]:
    """(param_dtype, reduce_dtype) from the mixed_precision option."""
    if isinstance(mixed_precision, dict):  # as a config read back from a saved Run holds it
        unknown = set(mixed_precision) - {"param_dtype", "reduce_dtype"}
        if unknown:
            raise ValueError(
                f"mixed_precision={mixed_precision!r}: unknown keys {sorted(unknown)}; valid keys: "
                f"param_dtype, reduce_dtype."
            )
        mixed_precision = MixedPrecision(**mixed_precision)
    if isinstance(mixed_precision, MixedPrecision):
        param = _dtype(mixed_precision.param_dtype)
        return param, param if mixed_precision.reduce_dtype is None else _dtype(mixed_precision.reduce_dtype)
    dtype = compute_dtype(mixed_precision) or torch.float32
    return dtype, dtype


def _dtype(value) -> torch.dtype:
    if value in (torch.float32, "float32", "fp32", "torch.float32"):
        return torch.float32
    try:
        dtype = compute_dtype(value) if not isinstance(value, bool) else None
    except ValueError:
        dtype = None
    if dtype is None:
        raise ValueError(
            f"MixedPrecision dtype {value!r}: use torch.float32, torch.bfloat16 or torch.float16 (or their names)."
        )
    return dtype


_GROUPS: dict = {}


def sharding_groups(F: int, group=None):
    """(shard group, replica group) of this rank among the ranks of `group` (default: every rank)."""
    if group is not None:
        return _subgroups(F, comm.group_ranks(group), group)
    world, rank = dist.get_world_size(), dist.get_rank()
    if F == world:
        return None, None
    key = (id(dist.group.WORLD), F)
    if key not in _GROUPS:  # every rank creates every group, in the same order
        shards = [dist.new_group(list(range(g * F, (g + 1) * F))) for g in range(world // F)]
        replicas = [dist.new_group(list(range(i, world, F))) for i in range(F)]
        _GROUPS[key] = (shards, replicas)
    shards, replicas = _GROUPS[key]
    return shards[rank // F], replicas[rank % F]


def _subgroups(F: int, ranks: list, group):
    """Within a sub-group (the dp group of a dp x tp layout): shards of F consecutive members, replicas
    across them. Only the members create them (other sub-groups make their own)."""
    if F == len(ranks):
        return group, None
    key = (tuple(ranks), F)
    if key not in _GROUPS:
        me = ranks.index(dist.get_rank())
        _GROUPS[key] = tuple(
            dist.new_group(members, use_local_synchronization=True)
            for members in (ranks[me // F * F : (me // F + 1) * F], ranks[me % F :: F])
        )
    return _GROUPS[key]


def _named(handle, unit_name: str):
    """Name the unit on the collective's trace record (the timeline then says whose it is)."""
    handle.event["args"]["unit"] = unit_name
    return handle


class FSDPUnit:
    """One unit's flat parameter and its state. Attributes:

    name, module, params   the unit's module and its parameters (views of `flat`), in layout order
    flat                   FlatBuffer in param_dtype: the gathered parameters; 0 bytes while sharded
    master                 this rank's fp32 slice (an nn.Parameter: what the optimizer steps)
    mine                   the `Shard` the optimizer sees: master and its reduced fp32 gradient
    grads                  FlatBuffer in reduce_dtype: full gradients while they arrive in backward
    state                  SHARDED, GATHERING or GATHERED
    """

    def __init__(self, plan, sharding: Sharding, *, param_init_fn=None, holders=None):
        self.name, self.module, self.sharding = plan.name or "(root)", plan.module, sharding
        self.moved_in = plan.moved_in
        shapes = [p.shape for p in plan.params]
        # The whole unit exists once, here, in fp32: the values every rank agrees on.
        full = FlatBuffer(shapes, sharding.size, dtype=torch.float32, device=sharding.device)
        if param_init_fn is not None:  # deferred initialization: the meta parameters become real now
            self.params = materialize(plan.params, full.views(), holders, param_init_fn, plan.name)
        else:
            full.copy_from(plan.params)
            self.params = list(plan.params)
        self.index = {p: i for i, p in enumerate(self.params)}
        self.master = nn.Parameter(full.shard(sharding.rank).clone())  # the one copy kept, fp32
        self.mine = Shard(self.master)
        self.flat = (
            full
            if sharding.param_dtype == torch.float32
            else FlatBuffer(shapes, sharding.size, data=full.data.to(sharding.param_dtype))
        )
        self.views = ParamViews(self.params, self.flat, self.master, sharding.rank)
        self.views.sharded()  # the module's parameters: this rank's pieces of the master until FSDP gathers the unit
        self.flat.free()
        self.state = SHARDED
        self.grads: FlatBuffer | None = None
        self.waiting = len(self.params)  # gradients not yet arrived in this backward
        self.backward_started = False
        self._gather = None  # (handle, input) of the all-gather in flight
        self.reduction = (
            None  # (handle, output, input) of the reduce-scatter in flight (input None: the replicas' all-reduce)
        )

    # --- 1. unshard: all-gather the flat parameter ----------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        """Make the full parameters appear: give the flat buffer memory, all-gather every rank's slice
        into it (cast to param_dtype on the way). With async_op, return while the gather is in flight."""
        if self.state == SHARDED:
            self.flat.allocate()
            piece = self.master.detach().to(self.sharding.param_dtype)  # fp32: the master itself, no copy
            handle = _named(
                comm.all_gather(self.flat.data, piece, group=self.sharding.shard_group, async_op=True), self.name
            )
            self._gather, self.state = (handle, piece), GATHERING
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        if self.state == GATHERING:
            self._gather[0].wait()
            self._gather, self.state = None, GATHERED

    # --- 2. reshard: free the gathered copy -------------------------------------------------------------
    def reshard(self) -> None:
        """Drop the full parameters: the storage shrinks to 0 bytes, the views (and autograd's references
        to them) stay valid and are refilled by the next unshard. The master slice is untouched."""
        if self.state == GATHERING:
            self.wait_unshard()  # never free memory a collective is still writing into
        self.flat.free()
        self.state = SHARDED

    # --- 3. gradients: collect, reduce-scatter, keep the slice -------------------------------------------
    def add_grad(self, p: nn.Parameter) -> bool:
        """`p.grad` is final for this backward: leave it where autograd put it (`flatten_grads` moves it once
        the unit's backward is done). Returns True when it was the unit's last one.

        Why wait: a flat buffer made at the first gradient would hold the whole unit's gradient for the
        whole of the unit's backward (and the root's, whose layer norm is reached first and whose tied
        embedding last, for the whole backward). FSDP2 keeps each gradient as autograd made it until the
        unit is done, then copies them into the reduce-scatter's input; so does this unit."""
        self.waiting -= 1
        return self.waiting == 0

    def flatten_grads(self) -> None:
        """The unit's backward is done: move its parameters' gradients into the flat gradient buffer (made now,
        zeros: padding and parameters without a gradient contribute nothing), each freed once copied."""
        arrived = [p for p in self.params if p.grad is not None]
        if arrived and self.grads is None:
            self.grads = FlatBuffer(
                self.flat.shapes, self.sharding.size, dtype=self.sharding.reduce_dtype, device=self.master.device
            )
        for p in arrived:
            self.grads.view(self.index[p]).add_(p.grad)  # add: micro-batches under no_sync() accumulate here
            p.grad = None

    def reduce_grad(self) -> None:
        """Average the flat gradient over the shard group, rank r receiving slice r (asynchronously)."""
        out = torch.empty(self.grads.shard_numel, dtype=self.sharding.reduce_dtype, device=self.master.device)
        handle = _named(
            comm.reduce_scatter(out, self.grads.data, op="avg", group=self.sharding.shard_group, async_op=True),
            self.name,
        )
        self.reduction, self.grads = (handle, out, self.grads), None

    def advance_reduce(self) -> None:
        """Between two units' backward: finish this unit's reduce-scatter without waiting on the replicas'
        all-reduce (it stays in flight; see `finish_reduce`). A unit class that writes its own
        `finish_reduce` (the labs' units) has it called here as it is."""
        if type(self).finish_reduce is not FSDPUnit.finish_reduce:
            self.finish_reduce()
        else:
            self.finish_reduce(wait_replicas=False)

    def finish_reduce(self, wait_replicas: bool = True) -> None:
        """Wait for the reduce-scatter; add the slice into the fp32 gradient of the shard.

        With hybrid sharding the slice is averaged over the replicas too (each replica group holds the same
        slice): the all-reduce starts once the reduce-scatter is done, and with `wait_replicas=False` it is
        left in flight (`reduction` then holds it, input None) while backward goes on, as torch FSDP runs
        it behind the next units' work; the next call waits for it and finishes.
        """
        handle, out, given = self.reduction
        handle.wait()
        if given is not None and self.sharding.replica_group is not None:
            handle = _named(comm.all_reduce(out, op="avg", group=self.sharding.replica_group, async_op=True), self.name)
            self.reduction = (handle, out, None)
            if not wait_replicas:
                return
            handle.wait()
        self.reduction = None
        out = out.to(torch.float32)
        self.mine.grad = out if self.mine.grad is None else self.mine.grad.add_(out)

    # --- views for people ---------------------------------------------------------------------------------
    @property
    def numel(self) -> int:
        return self.flat.numel

    def __repr__(self) -> str:
        return f"FSDPUnit({self.name!r}, {len(self.params)} parameters, {self.flat}, {self.state})"
