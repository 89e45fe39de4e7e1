"""ZeRO stage 3: each rank stores only its slice of the parameters; a module's parameters exist in
full only while that module computes.

The DeepSpeed way, at submodule granularity: every module that owns parameters directly (an
Embedding, a Linear, a LayerNorm) is a *unit*; its parameters are flattened into one padded buffer
(`flat.py`) of which this rank keeps slice r. Hooks then run the step, in this order:

  forward   pre-hook   all-gather the unit (the module's full parameters appear)
            hook       free it again (its memory drops to 0 bytes), and put a hook on the output
  backward  output's gradient arrives -> backward is about to enter the module: all-gather again
            each parameter's gradient is final (post-accumulate hook) -> into the unit's flat gradient;
            the unit's last one -> free the parameters, reduce-scatter the gradients into the
            owners' slices (rank r receives the average of slice r), free the full gradients
  step      the optimizer updates each rank's fp32 slice; nothing is gathered until the next forward

So every step moves Ψ three times (gather in forward, gather in backward, reduce-scatter), 1.5x
ZeRO-1/2's 2Ψ, to hold (2 + 2 + K)Ψ/N bytes of model states per rank.

How "free" works: while a unit computes, the module's parameters are views of its flat buffer; freeing
resizes that buffer's storage to 0 bytes and points the parameters at this rank's pieces of them
(`flat.ParamViews`: 1-D, empty where the rank holds none, safe to read). Autograd keeps references to
the parameters (and views of them) for backward; those references stay valid, and the backward gather
refills the same storage and points the parameters back before they are read (FSDP2 does the same).

Tied parameters: the GPT's token embedding is also its output head. A parameter belongs to the unit
of the first module that owns it (the embedding); every module that uses it directly (the head too)
is a *user* of that unit. In forward the unit stays gathered until its last user has run (so it is
gathered once, not twice); in backward it stays gathered until its gradient is complete, which for
a tied weight is after the embedding's backward, the very end. (FSDP asks for tied parameters to be
in one unit for the same reason.)

Buckets (DeepSpeed's `stage3_prefetch_bucket_size` and `reduce_bucket_size`, in elements; 0, the
default, is the plain per-module picture above). Small modules make many small collectives, and each
pays a fixed cost. With `prefetch_bucket_size=B`, gathering a unit also gathers the units that come
next (in the order the first forward ran them, reversed in backward) until B elements, all in one
all-gather. With `reduce_bucket_size=B`, finished units wait until B elements of gradients are ready,
then go in one reduce-scatter. The bytes moved and the model states stay the same. The peak grows by
up to a bucket of gathered parameters, twice that while a bucket is copied out into its units.

The step, in sub-groups (DeepSpeed's `sub_group_size`, in elements; 0, the default, is one module at a
time). With mixed precision the reduced gradient slices are 16-bit, and the optimizer steps fp32 masters
with fp32 gradients. Copying every slice to fp32 at once would hold 4Ψ/N bytes more than the model states
at the step (1.2x FSDP2's peak when the states are most of it); stepping one sub-group after another, only
that sub-group's fp32 gradients exist (DeepSpeed does the same). fp32 training steps everything at once:
its gradients need no copy.

Limits: a module's parameters must be used through that module's forward (from outside, between
uses, `module.weight` is this rank's piece of it), and every rank must run the same modules in the
same order (collectives must match).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from .. import comm
from .flat import FlatBuffer
from .grad_in_slices import real_grads
from .sharded import ShardedEngine
from .zero3_unit import Unit

# Modules whose forward reads their submodules' parameters without calling those submodules: torch's
# MultiheadAttention passes out_proj.weight to a functional call. Their unit holds everything below them.
READS_CHILDREN = (nn.MultiheadAttention,)


def _read_elsewhere(what: str) -> RuntimeError:
    return RuntimeError(
        "zero3 gathers a module's parameters only while that module's own forward runs, and this model read a "
        "parameter at another time (a parent module using a child's weight directly, without calling the child): "
        f"{what}. Use fsdp for this model: its units are whole layers."
    )


class Zero3(ShardedEngine):
    """ZeRO-3: each module's parameters gathered for its forward and for its backward, then freed."""

    name = "zero3"

    def __init__(
        self, module: nn.Module, dtype, group=None, prefetch_bucket_size=0, reduce_bucket_size=0, sub_group_size=0
    ):
        super().__init__(module, dtype, group)
        self.prefetch_bucket_size, self.reduce_bucket_size = prefetch_bucket_size, reduce_bucket_size
        self.sub_group_size = sub_group_size
        self.order: list[Unit] = []  # units in the order the first forward gathered them
        self.gathered_now: set = set()  # units gathered for their forward in this forward pass
        self.ready: list[Unit] = []  # units whose gradients wait for a reduce bucket to fill
        self.unit_of, self.uses = {}, {}
        whole = []  # modules gathered with everything below them (READS_CHILDREN)
        for name, m in module.named_modules():
            if any(name.startswith(w + ".") for w in whole):
                continue  # its parameters are in the enclosing module's unit
            if isinstance(m, READS_CHILDREN):
                whole.append(name)
            own = [p for p in m.parameters(recurse=name in whole) if p.requires_grad]
            new = [p for p in own if p not in self.unit_of]
            if new:
                unit = Unit(self, name or "(root)", new)
                self.pieces.append(unit)
                self.unit_of.update({p: unit for p in new})
            uses = list(dict.fromkeys(self.unit_of[p] for p in own))  # its units, without repeats
            if uses:
                self.uses[m] = uses
                for unit in uses:
                    unit.users.append(m)
                m.register_forward_pre_hook(self._before_forward)
                m.register_forward_hook(self._after_forward)
        self.watch_gradients(self._gradient_ready)
        self.in_flight = []  # (units, handle, output, input) of launched reduce-scatters

    # --- gather and free -----------------------------------------------------------------------------
    def _gather(self, unit: Unit, backward: bool = False) -> None:
        if unit.flat.is_allocated:
            return
        if not backward and unit not in self.order:
            self.order.append(unit)
        if not backward:
            self.gathered_now.add(unit)
        units = [unit] + self._next(unit, backward)
        for u in units:
            u.flat.allocate()
        if len(units) == 1:
            comm.all_gather(unit.flat.data, unit.kept.detach(), group=self.group)
            unit.views.full()
            return
        sizes = [u.flat.shard_numel for u in units]  # one all-gather for the bucket, then each its part
        out = unit.flat.data.new_empty(self.world * sum(sizes))
        comm.all_gather(out, torch.cat([u.kept.detach() for u in units]), group=self.group)
        for u, part in zip(units, out.view(self.world, -1).split(sizes, dim=1)):
            u.flat.data.view(self.world, -1).copy_(part)
            u.views.full()

    def _next(self, unit: Unit, backward: bool) -> list:
        """The units to prefetch with `unit`: those that run next, up to the bucket's elements."""
        order = self.order[::-1] if backward else self.order
        if self.prefetch_bucket_size <= 0 or unit not in order:
            return []
        found, total = [], unit.flat.padded_numel
        for u in order[order.index(unit) + 1 :]:
            if total >= self.prefetch_bucket_size:
                break
            if not u.flat.is_allocated:
                found.append(u)
                total += u.flat.padded_numel
        return found

    @staticmethod
    def _free(unit: Unit) -> None:
        unit.flat.free()  # autograd's views of the parameters now hold 0 bytes (backward gathers again)
        unit.views.sharded()  # and the parameters are this rank's pieces

    # --- forward -------------------------------------------------------------------------------------
    def _before_forward(self, module, args) -> None:
        for unit in self.uses[module]:
            self._gather(unit)

    def _after_forward(self, module, args, output):
        for unit in self.uses[module]:
            unit.done_forward.add(id(module))
            if len(unit.done_forward) == len(unit.users):  # its last user in this forward is done
                self._free(unit)
                unit.done_forward.clear()
        if torch.is_grad_enabled():  # backward enters this module when its output's gradient arrives
            for t in tree_flatten(output)[0]:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(partial(self._before_backward, module))
        return output

    def forward(self, module, args, kwargs):
        self.gathered_now = set()
        try:
            return module(*args, **kwargs)
        except RuntimeError as exc:
            missed = [u.name for u in self.pieces if u not in self.gathered_now]
            if not missed:
                raise
            raise _read_elsewhere(
                f"the module(s) {missed} did not run, so their parameters were never gathered, "
                f"and this forward failed ({exc})"
            ) from exc
        finally:  # a unit whose later user did not run this time: free it (backward gathers again)
            for unit in self.pieces:
                unit.done_forward.clear()
                self._free(unit)

    # --- backward ------------------------------------------------------------------------------------
    def _before_backward(self, module, grad) -> None:
        self.queue_end_of_backward()
        for unit in self.uses[module]:
            self._gather(unit, backward=True)

    def _gradient_ready(self, p: nn.Parameter) -> None:
        """Hook: p.grad is final for this backward. Collect it; the unit's last one triggers the reduction."""
        unit = self.unit_of[p]
        if not unit.views.is_full:  # computed from this rank's piece: the model read it outside its module
            raise _read_elsewhere(f"{self.names[p]!r} got a gradient while its module was not running")
        if unit.grads is None:
            unit.grads = FlatBuffer(unit.flat.shapes, self.world, dtype=self.dtype, device=p.device)
        unit.grads.view(unit.index[p]).copy_(p.grad)
        p.grad = None
        unit.waiting -= 1
        if unit.waiting == 0:  # every user's backward is done with this unit
            self._free(unit)
            self.ready.append(unit)
            if sum(u.grads.padded_numel for u in self.ready) >= self.reduce_bucket_size:
                self._reduce_scatter()

    def _reduce_scatter(self) -> None:
        """The ready units' gradients, averaged into their owners' slices: one reduce-scatter."""
        units, self.ready = self.ready, []
        if len(units) == 1:
            grads = units[0].grads.data
        else:  # rank r's part of every unit, side by side: the layout a reduce-scatter splits
            grads = torch.cat([u.grads.data.view(self.world, -1) for u in units], dim=1).reshape(-1)
        out = torch.empty(grads.numel() // self.world, dtype=self.dtype, device=grads.device)
        self._settle()  # the previous reduction is done by now: free its full gradients first
        handle = comm.reduce_scatter(out, grads, op="avg", group=self.group, async_op=True)
        self.in_flight.append((units, handle, out, grads))
        for u in units:
            u.grads = None

    def end_of_backward(self) -> None:
        for unit in self.pieces:
            if unit.grads is not None and unit not in self.ready:  # some parameters got no gradient
                self.ready.append(unit)
            unit.waiting = len(unit.params)
            self._free(unit)
        if self.ready:
            self._reduce_scatter()
        self._settle()

    def _settle(self) -> None:
        """Wait for the launched reduce-scatters, add each result into its owners' slices, drop its input.

        Called before each new reduction, so at most one reduction's full gradients are in flight (as
        in torch FSDP); keeping them all until the end of backward would hold the whole model's
        16-bit gradients at the peak.
        """
        for units, handle, out, _ in self.in_flight:  # accumulate: add into the slices
            handle.wait()
            parts = out.split([u.flat.shard_numel for u in units]) if len(units) > 1 else [out]
            for unit, part in zip(units, parts):
                unit.mine.grad = part if unit.mine.grad is None else unit.mine.grad.add_(part)
        self.in_flight = []

    # --- step ----------------------------------------------------------------------------------------
    def step_groups(self) -> list:
        """Consecutive modules' shards, up to `sub_group_size` elements (one module each at 0): the optimizer
        steps one sub-group after another, so only one sub-group's gradients are copied to fp32 at a time."""
        if self.dtype == torch.float32:
            return [self.shards()]  # the gradients are fp32 already: no copy to spread out
        groups, size = [], 0
        for unit in self.pieces:
            n = unit.mine.master.numel()
            if groups and size + n <= self.sub_group_size:
                groups[-1].append(unit.mine)
                size += n
            else:
                groups.append([unit.mine])
                size = n
        return groups

    @torch.no_grad()
    def after_step(self) -> None:
        """Nothing to gather: the next forward gathers what it needs. Mixed precision: refresh the 16-bit slice."""
        if self.dtype != torch.float32:
            for unit in self.pieces:
                unit.kept.copy_(unit.mine.master)

    def memory_groups(self) -> dict:
        grads = [u.mine.grad for u in self.pieces if u.mine.grad is not None]
        grads += [u.grads.data for u in self.pieces if u.grads is not None] + [t[3] for t in self.in_flight]
        grads += real_grads(self.params)
        params = [u.flat.data for u in self.pieces] + [u.kept for u in self.pieces] + self.frozen
        return {"params": params, "grads": grads, "optimizer": self.optimizer_tensors()}
