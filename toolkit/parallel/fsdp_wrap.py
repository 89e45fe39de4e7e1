"""FSDP's setup: `wrap(model, optimizer, **options)` checks every option, builds the shard and replica groups,
places the model and starts every rank from rank 0's values, then hands the units to the engine (`fsdp.py`,
where a step happens). `FSDPModel` is what the user holds afterwards. The options are documented in fsdp.py."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from ..memory.ledger import record_memory
from ..runtime import env
from ..trace.events import phase, recorder
from . import check_options, consistency
from .checkpointing import period
from .fsdp import FullyShardedDataParallel
from .fsdp_init import check_deferred, is_deferred, materialize_buffers
from .fsdp_policy import explain, plan
from .fsdp_unit import FSDPUnit, Sharding, dtypes, sharding_groups
from .sharded import ShardedModel
from .sharded_optimizer import ShardedOptimizer, check_optimizer

OPTIONS = (
    "wrap_policy",
    "reshard_after_forward",
    "forward_prefetch",
    "backward_prefetch",
    "sharding_group_size",
    "mixed_precision",
    "activation_checkpointing",
    "param_init_fn",
    "unit_class",
    "limit_all_gathers",
    "group",
)
NO_RATE_LIMITER = (
    "fsdp: limit_all_gathers=True asks for torch FSDP's rate limiter, which this FSDP does not have. It exists "
    "for GPUs, where the CPU issues kernels ahead of the device and could all-gather unit after unit before "
    "earlier ones are freed; the limiter keeps at most two units in flight. Here a unit's forward finishes on "
    "the host before the next unit is gathered, so the bound holds without it on the CPU; on GPUs this FSDP "
    "can use more memory than torch's. Leave the option out (or pass limit_all_gathers=False); "
    "docs/differences.md lists what else differs from torch FSDP."
)


def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"fsdp: {name} must be True or False, got {value!r}.")
    return value


def wrap(model: nn.Module, optimizer=torch.optim.AdamW, **options):
    """Wrap `model` for FSDP. Returns (wrapped model, sharded optimizer over the fp32 slices)."""
    check_options("fsdp", options, OPTIONS)  # every mistake is reported before any collective
    if _flag("limit_all_gathers", options.pop("limit_all_gathers", False)):
        raise ValueError(NO_RATE_LIMITER)
    check_optimizer("fsdp", optimizer)
    param_dtype, reduce_dtype = dtypes(options.get("mixed_precision", False))
    flags = {
        k: _flag(k, options.get(k, default))
        for k, default in (
            ("reshard_after_forward", True),
            ("forward_prefetch", False),
            ("backward_prefetch", True),
        )
    }
    flags["activation_checkpointing"] = options.get("activation_checkpointing", False)
    period(flags["activation_checkpointing"], "fsdp: ")  # refused here, before any collective
    unit_class = options.get("unit_class", FSDPUnit)
    if not (isinstance(unit_class, type) and issubclass(unit_class, FSDPUnit)):
        raise ValueError(f"fsdp: unit_class must be FSDPUnit or a subclass of it, got {unit_class!r}.")
    plans = plan(model, options.get("wrap_policy"))
    recorder.metric("fsdp/wrap_policy", explain(model, options.get("wrap_policy")))  # the Run says why these units
    init_fn = options.get("param_init_fn")
    deferred = is_deferred(model)
    if deferred:
        check_deferred(model, init_fn)
    elif init_fn is not None:
        raise ValueError(
            "param_init_fn is for a model built on the meta device (deferred initialization); "
            "this model already has values. Build it under `with torch.device('meta'):`."
        )
    if not dist.is_initialized():
        raise RuntimeError(
            "fsdp shards over ranks, so it needs torch.distributed initialized: run it inside "
            "toolkit.launch(fn, world_size) (world_size=1 works too), or call "
            "toolkit.runtime.init() under torchrun or mpirun."
        )
    group = options.get("group")
    world = len(comm.group_ranks(group))
    F = options.get("sharding_group_size") or world
    if isinstance(F, bool) or not isinstance(F, int) or F < 1 or world % F:
        valid = [f for f in range(1, world + 1) if world % f == 0]
        raise ValueError(
            f"fsdp: sharding_group_size={options.get('sharding_group_size')!r} must divide the "
            f"world size {world} (shard groups of F ranks, replicated {world}/F times); valid "
            f"values here: {valid}."
        )
    consistency.check_same_model(model, group)  # a clear error now rather than a hang later
    shard_group, replica_group = sharding_groups(F, group)
    sharding = Sharding(shard_group, replica_group, param_dtype, reduce_dtype)
    if not deferred:
        model.to(env.device())
    else:  # parameters stay on meta until their unit materializes them; buffers are made now (fsdp_init.py)
        materialize_buffers(model, env.device(), init_fn)
    with phase("setup"):  # every rank starts from rank 0's values (deferred: the seeded init agrees already)
        consistency.broadcast_from_rank0([*([] if deferred else model.parameters()), *model.buffers()], group)
    engine = FullyShardedDataParallel(
        model, plans, sharding, init_fn=init_fn if deferred else None, unit_class=unit_class, **flags
    )
    engine.optimizer = ShardedOptimizer(optimizer([u.master for u in engine.units]), engine)
    return FSDPModel(model, engine), engine.optimizer


class FSDPModel(ShardedModel):
    """The wrapped model: forward as the original's; `full_state_dict()`, `memory_groups()`,
    `clip_grad_norm_()`, `no_sync()` as every sharded strategy; plus the units and a memory probe."""

    @property
    def units(self) -> list[FSDPUnit]:
        return self.engine.units

    def describe(self) -> list[dict]:
        """One row per unit: name, parameter names, elements, padded elements, elements per shard."""
        return [
            {
                "unit": u.name,
                "params": list(u.param_names),
                "numel": u.flat.numel,
                "padded_numel": u.flat.padded_numel,
                "shard_numel": u.flat.shard_numel,
                "moved_in": [name for name, _ in u.moved_in],
            }
            for u in self.units
        ]

    def unshard_ahead(self) -> None:
        """Start gathering the units this stage's first forward of the step needs, before it runs (a pipeline's
        `driver.py` calls it one action ahead), so that the all-gathers run while another stage computes rather
        than once the activation has arrived: all of them where they stay gathered through the step
        (reshard_after_forward=False), the first otherwise. torch's pipelining schedules do the same: an UNSHARD
        action issued ahead of a stage's first use (`schedules._add_unshard_reshard`)."""
        engine = self.engine
        for unit in engine.forward_order if not engine.reshard_after_forward else engine.forward_order[:1]:
            unit.unshard(async_op=True)
            engine._probe("prefetch", unit)

    @contextlib.contextmanager
    def sync_backward(self, reduce: bool):
        """A pipeline's backward of one micro-batch (`pipeline/driver.py`): the stage's last one reduces, the
        others run under no_sync(). With reshard_after_forward=False the units are not freed after those others
        either, so each unit is gathered in the step's first forward and freed after its last backward: one
        all-gather per step instead of one per micro-batch (torchtitan's default under pp, where torch's
        PipelineStage sets FSDP2's reshard_after_backward to False for all but the last backward), for the
        stage's parameters held whole through the step."""
        engine = self.engine
        before = engine.sync, engine.reshard_after_backward
        engine.sync = reduce
        engine.reshard_after_backward = reduce or engine.reshard_after_forward
        try:
            yield
        finally:
            engine.sync, engine.reshard_after_backward = before

    @contextlib.contextmanager
    def watch_memory(self, meter=None, step=None, probe=None):
        """Inside, record a memory sample into the trace at every gather, free and reduction (the event
        and the unit are in the sample), so a step's memory over time shows each unit come and go.
        `probe(event, unit)` replaces the recording with your own function."""

        def record(event, unit):
            record_memory(self, self.engine.optimizer, step=step, meter=meter, event=f"{event} {unit.name}")

        fn = probe or record
        self.engine.probes.append(fn)
        try:
            yield self
        finally:
            self.engine.probes.remove(fn)
