"""FSDP: fully sharded data parallelism, as PyTorch's FSDP paper describes it.

ZeRO-3 (`zero3.py`) already stores only a 1/N slice of every parameter and gathers each module's
parameters just in time. FSDP organizes the same idea around *units* chosen by a wrap policy
(`fsdp_policy.py`; by default one per transformer block, plus the root for the rest): each unit's
parameters are one flat parameter (`fsdp_unit.py`), so a unit costs exactly one all-gather and one
reduce-scatter whatever its number of tensors, and what is in memory at any time is "the shards, plus
the unit(s) in flight": peak parameter bytes about Σψ_i/F + max ψ_i. What else differs from zero3.py:
explicit prefetching, hybrid sharding, per-unit activation checkpointing, deferred initialization and
checkpoints. (Why one flat parameter per unit, not FSDP2's per-parameter dim-0 shards: fsdp_unit.py.)

A step, in the order things happen (reshard_after_forward=True, the default):

  forward   unit pre-hook    all-gather the unit (1st all-gather)    [forward_prefetch: also issue the
                                                                      next unit's all-gather now]
            the unit's module computes (a nested unit gathers and frees itself inside)
            unit post-hook   free the gathered copy; hook the outputs so backward can find the unit
  backward  output's gradient arrives -> all-gather again (2nd)      [backward_prefetch: also issue the
                                                                      all-gather of the unit backward
                                                                      reaches next, before this unit's
                                                                      reduce-scatter]
            every parameter's gradient is final -> free the unit, reduce-scatter its gradient (the
            previous unit's reduce-scatter is finished first: at most one in flight; with hybrid
            sharding its all-reduce over the replicas then starts, and runs behind this unit's work)
  end of backward  finish every reduction: each rank holds the averaged gradient of its slices only
  step      the optimizer updates the fp32 slices; nothing is gathered until the next forward

Per step every unit moves its Ψ_i three times: 3Ψ(N-1)/N bytes per rank, 1.5x data parallelism.
`reshard_after_forward=False` keeps each unit gathered from its forward until its backward (no 2nd
all-gather: 2Ψ, and ZeRO-2-like parameter memory).

Options (checked by `fsdp_wrap.wrap`, which builds the groups and the units):
  wrap_policy            which modules are units (see fsdp_policy.py); the root always is one.
  reshard_after_forward  True (default) or False, as above. (FSDP2 keeps the *root* gathered after
                         forward as a heuristic, backward needing it at once; here every unit obeys the
                         option, so the count above is exact.)
  forward_prefetch       False (default) or True.
  backward_prefetch      True (default, torch FSDP's BACKWARD_PRE) or False. Prefetching overlaps a
                         unit's all-gather with the computation before it, at the price of one more
                         unit in memory.
  sharding_group_size    F (default: the world size). Hybrid sharding (HSDP) with F < N: shard within
                         groups of F consecutive ranks, replicate across the N/F groups; a gradient is
                         reduce-scattered within its shard group, then all-reduced across the replicas.
                         F must divide the world size (the group's size).
  group                  the process group to shard over (default every rank; under tensor parallelism
                         compose.py passes the dp group: torchtitan's 2D FSDP + TP).
  mixed_precision        False (fp32), True (bfloat16), a dtype or its name, or `MixedPrecision(param_dtype,
                         reduce_dtype)`: parameters gathered and computed in param_dtype, gradients reduced
                         in reduce_dtype; the shards, their gradients and the optimizer states stay fp32
                         (4 + 4 + 8 = the same 16 bytes per parameter as (2 + 2 + 12), split differently).
  activation_checkpointing  False (default) or True: every unit but the root runs its forward under
                         torch.utils.checkpoint (use_reentrant=False): its activations are recomputed in
                         backward, after the unit has been gathered again. k: every k-th of those units
                         only; "op": every unit by operation; "attention": its core attention (checkpointing.py).
  param_init_fn          for a model built on the meta device (deferred initialization, fsdp_init.py).
  unit_class             the class that does a unit's work (default `FSDPUnit`): a lab's subclass that
                         re-implements `unshard`/`reshard` (or the gradient reduction) plugs in here.

Gradient accumulation: call backward on every micro-batch; each one reduce-scatters and adds into the
slices. Or run all but the last inside `model.no_sync()`: those keep the unit's *full* gradient and skip
the reduce-scatter, and the last backward reduces the sum once (less communication, Ψ more memory).
Under a pipeline (`FSDPModel.sync_backward`) with reshard_after_forward=False the units also stay gathered
after all but the last backward (FSDP2's `set_reshard_after_backward(False)`, which torch's pipeline stages
set): a unit is gathered once per step whatever the number of micro-batches (torchtitan's FSDP + PP).
`model.clip_grad_norm_(max)` clips by the norm of the whole averaged gradient (every rank's slices).
Checkpoints: `toolkit.parallel.checkpoint`.

Limits: a unit's parameters must be used inside its module's forward, and gradients must reach them
through that forward's outputs (reading `module.weight` between uses sees an empty tensor); every rank
runs the same units in the same order.

Absent: torch FSDP's rate limiter (`limit_all_gathers=True`): on a GPU the host can issue unit after unit's
all-gather before the device has freed the earlier ones; the limiter keeps two units in flight. On the CPU a
unit's forward finishes before the next hook runs, so the bound holds without it (`fsdp_wrap.NO_RATE_LIMITER`).
See docs/differences.md for every difference from torch FSDP.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from ..trace.events import recorder
from .checkpointing import checkpoint_modules
from .fsdp_init import initialize, owners, seeded_init  # noqa: F401 - re-exported
from .fsdp_unit import SHARDED, FSDPUnit, MixedPrecision, Sharding  # noqa: F401 - re-exported
from .grad_in_slices import real_grads
from .sharded import ShardedEngine


class FullyShardedDataParallel(ShardedEngine):
    """The schedule: when each unit is gathered, freed and reduced (the units do the work)."""

    name = "fsdp"

    def __init__(
        self,
        module: nn.Module,
        plans,
        sharding: Sharding,
        *,
        init_fn=None,
        unit_class=FSDPUnit,
        reshard_after_forward=True,
        forward_prefetch=False,
        backward_prefetch=True,
        activation_checkpointing=False,
    ):
        super().__init__(module, sharding.param_dtype, sharding.shard_group)
        self.sharding = sharding
        self.reshard_after_forward, self.forward_prefetch = reshard_after_forward, forward_prefetch
        self.backward_prefetch = backward_prefetch
        holders = owners(module) if init_fn is not None else None
        self.units = [unit_class(p, sharding, param_init_fn=init_fn, holders=holders) for p in plans]
        self.pieces = self.units
        # deferred initialization made new Parameter objects: name them again
        self.names = {p: n for n, p in module.named_parameters()}
        self.params = [p for p in self.names if p.requires_grad]
        self.unit_of = {p: u for u in self.units for p in u.params}
        for unit in self.units:
            unit.param_names = [self.names[p] for p in unit.params]
            unit.module.register_forward_pre_hook(functools.partial(self._pre_forward, unit))
            unit.module.register_forward_hook(functools.partial(self._post_forward, unit))
        checkpoint_modules(module, [u.module for u in self.units if u.module is not module], activation_checkpointing)
        self.watch_gradients(self._on_grad)
        self.forward_order = list(self.units)  # a guess (model order) until a forward has run
        self._order, self._post_order, self.backward_order = [], [], []
        self.in_backward, self.sync = False, True
        self.reshard_after_backward = True  # False: units stay gathered after backward (`FSDPModel.sync_backward`)
        self.probes: list = []  # fn(event, unit) called at every gather, free and reduction

    def _probe(self, event: str, unit: FSDPUnit) -> None:
        for probe in self.probes:
            probe(event, unit)

    @staticmethod
    def _after(order: list, unit: FSDPUnit):
        """The unit that comes after `unit` in `order` (None at the end)."""
        i = order.index(unit) + 1 if unit in order else len(order)
        return order[i] if i < len(order) else None

    # --- gathered for use, freed after ----------------------------------------------------------------
    @staticmethod
    def _unshard(unit: FSDPUnit) -> None:
        """The unit's full parameters, for its module to compute with: gathered (waiting for a prefetch),
        the module's parameters pointed at them."""
        unit.unshard()
        unit.views.full()

    @staticmethod
    def _reshard(unit: FSDPUnit) -> None:
        """The full parameters freed, the module's parameters pointed at this rank's pieces of them."""
        unit.reshard()
        unit.views.sharded()

    # --- forward -------------------------------------------------------------------------------------
    def forward(self, module, args, kwargs):
        if self.in_backward:  # the last backward raised before its end: start from a clean state
            for unit in self.units:
                self._reshard(unit)
                unit.grads, unit.waiting, unit.backward_started = None, len(unit.params), False
                for p in unit.params:  # gradients that were waiting for the unit's end
                    p.grad = None
            self.in_backward = False
        self._order, self._post_order = [], []
        try:
            output = module(*args, **kwargs)
            skipped = [u.name for u in self.units if u not in self._order]
            if skipped:  # its parameters were never gathered: anything that read them read nothing
                raise RuntimeError(
                    f"fsdp: the module of unit(s) {skipped} was not called in this forward, so "
                    f"its parameters were never gathered. Every unit's module must run its own "
                    f"forward (choose units whose forward the model calls)."
                )
            return output
        finally:
            if self._order:  # next time, prefetch in the order this forward ran
                self.forward_order = self._order + [u for u in self.units if u not in self._order]
            for unit in self.units:  # prefetched but not run, or everything if forward failed
                if unit.state != SHARDED and (
                    unit not in self._post_order or self.reshard_after_forward or not torch.is_grad_enabled()
                ):
                    self._reshard(unit)

    def _pre_forward(self, unit: FSDPUnit, module, args) -> None:
        if self.in_backward:  # a recomputation under activation checkpointing: just make sure it is there
            self._unshard(unit)
            return
        self._order.append(unit)
        self._unshard(unit)  # waits for it (it may have been prefetched)
        self._probe("gathered", unit)
        if self.forward_prefetch and (nxt := self._after(self.forward_order, unit)) is not None:
            nxt.unshard(async_op=True)  # in flight while this unit computes
            self._probe("prefetch", nxt)
        unit.span = recorder.open(f"forward {unit.name}", "fsdp", unit=unit.name)

    def _post_forward(self, unit: FSDPUnit, module, args, output):
        if self.in_backward:
            return output
        recorder.close(unit.span)
        self._post_order.append(unit)
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self._reshard(unit)
            self._probe("freed", unit)
        if torch.is_grad_enabled():  # backward enters the unit when its outputs' gradients arrive
            for t in tree_flatten(output)[0]:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(functools.partial(self._pre_backward, unit))
        return output

    # --- backward ------------------------------------------------------------------------------------
    def _pre_backward(self, unit: FSDPUnit, grad) -> None:
        if not self.in_backward:  # the first unit of this backward
            self.in_backward = True
            self.queue_end_of_backward()
            self.backward_order = self._post_order[::-1]  # backward visits units in reverse
        if unit.backward_started:
            return
        unit.backward_started = True
        self._unshard(unit)
        self._probe("gathered", unit)
        if self.backward_prefetch and (nxt := self._after(self.backward_order, unit)) is not None:
            nxt.unshard(async_op=True)  # before this unit's reduce-scatter is issued
            self._probe("prefetch", nxt)
        unit.span = recorder.open(f"backward {unit.name}", "fsdp", unit=unit.name)

    def _on_grad(self, p: nn.Parameter) -> None:
        unit = self.unit_of[p]
        if unit.add_grad(p):  # the unit's last gradient of this backward
            self._post_backward(unit)

    def _post_backward(self, unit: FSDPUnit) -> None:
        if getattr(unit, "span", None) is not None and unit.span["end"] is None:
            recorder.close(unit.span)
        self._probe("backward done", unit)
        if self.reshard_after_backward:
            self._reshard(unit)
            self._probe("freed", unit)
        if self.sync:
            for other in self.units:  # at most one reduce-scatter in flight (and one replicas' all-reduce)
                if other.reduction is not None:
                    other.advance_reduce()
            unit.flatten_grads()  # the previous unit's flat gradient is gone by now
            unit.reduce_grad()
            self._probe("reduce-scatter", unit)
        else:  # no_sync(): the flat gradient keeps the sum of the micro-batches
            unit.flatten_grads()

    def end_of_backward(self) -> None:
        for unit in self.units:
            if 0 < unit.waiting < len(unit.params):  # some parameter got no gradient in this backward
                self._post_backward(unit)
            elif self.sync and unit.grads is not None:  # accumulated under no_sync(), unused this time
                unit.reduce_grad()
            if self.reshard_after_backward:
                self._reshard(unit)
            unit.waiting, unit.backward_started = len(unit.params), False
        for unit in self.units:
            if unit.reduction is not None:
                unit.finish_reduce()
        self.in_backward = False

    def no_sync(self):
        return self._no_sync()

    @contextlib.contextmanager
    def _no_sync(self):
        """Backwards inside keep each unit's full gradient and skip the reduce-scatter; the next
        backward outside reduces the accumulated sum once."""
        before, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = before

    # --- step ----------------------------------------------------------------------------------------
    def before_step(self) -> None:
        if any(u.grads is not None for u in self.units):
            raise RuntimeError(
                "fsdp: the last backward ran inside model.no_sync(), so its gradients were not "
                "reduced; run the final micro-batch's backward outside no_sync() before step()."
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for unit in self.units:
            unit.grads = None

    def memory_groups(self) -> dict:
        params = [u.flat.data for u in self.units] + [u.master for u in self.units] + self.frozen
        grads = [u.mine.grad for u in self.units if u.mine.grad is not None]
        grads += [u.grads.data for u in self.units if u.grads is not None]
        grads += [t.data for u in self.units if u.reduction is not None for t in u.reduction[1:] if t is not None]
        grads += real_grads(self.params)
        optimizer = self.optimizer.state_tensors() if self.optimizer is not None else []
        return {"params": params, "grads": grads, "optimizer": optimizer}
