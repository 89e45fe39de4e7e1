"""ZeRO: data parallelism without the redundancy, in three stages.

Plain data parallelism keeps on every rank the parameters (P), their gradients (G) and the optimizer
states (O): (2 + 2 + K)Ψ bytes for Ψ parameters (K = 12 for mixed-precision Adam: fp32 master,
momentum, variance). ZeRO partitions them over the N ranks, one more kind per stage:

    stage 1  optimizer states   P + G + O/N     each rank steps only its slice of the parameters
    stage 2  + gradients        P + (G + O)/N   each rank keeps only its slice of the gradients
    stage 3  + parameters       (P + G + O)/N   each rank stores only its slice of the parameters

Every rank owns the same slice r of every flat buffer (`flat.py`) and updates it with an ordinary
optimizer (`sharded_optimizer.py`). What changes between stages is which collective runs when:

ZeRO-1  forward with full parameters -> backward fills full gradients -> when backward is over,
        reduce-scatter them (rank r receives the average of slice r) -> the optimizer steps slice r
        in fp32 -> all-gather the updated slices back into the full parameters.
ZeRO-2  as ZeRO-1, but each bucket of gradients is reduce-scattered *during* backward, as soon as it
        is complete, and its full gradients are freed at once: only the slice stays.
ZeRO-3  parameters live as slices only: all-gathered just before a module's forward and freed right
        after, gathered again for its backward, then its gradients are reduce-scattered into the
        owners' slices. Three passes over Ψ per step instead of two (see `zero3.py`).

Options (every stage):
  mixed_precision  False (fp32), True (bfloat16) or a 16-bit dtype: 16-bit parameters and gradients
                   for compute and communication, fp32 master weights and fp32 optimizer states
                   (2 + 2 + 12 bytes per parameter), as in "local" and "ddp".
  group            the process group to shard over (default: every rank).
ZeRO-1 and ZeRO-2:
  bucket_cap_mb    MiB of gradients per bucket (25, as DDP): the unit of a reduce-scatter.
ZeRO-3:
  prefetch_bucket_size, reduce_bucket_size   elements per all-gather / reduce-scatter (DeepSpeed's
                   names), 0 by default: one module at a time. See `zero3.py`.
  sub_group_size   elements the optimizer steps at once (DeepSpeed's name), 0 by default: one module's
                   slice at a time, so that only its gradient exists in fp32 (mixed precision). See `zero3.py`.
ZeRO-1:
  reduce           "reduce_scatter" (default), or "all_reduce": every rank receives the whole averaged
                   gradient and uses only its slice. Same result, DDP's traffic plus the all-gather
                   (3Ψ instead of 2Ψ): the notebook's contrast for why a reduce-scatter is enough.

Gradient accumulation. ZeRO-1 keeps full gradients anyway, so it accumulates like DDP: run every
backward but the last inside `model.no_sync()`; the last one reduces the sum once. ZeRO-2 and ZeRO-3
keep only a slice, so every backward reduce-scatters and *adds* into the slice: just call backward
on each micro-batch before `step()`. Their no_sync() is accepted (one loop serves every strategy) but
changes nothing: postponing the reduction would need the full gradients they do not keep.

What the user sees of `model.module`'s parameters: ZeRO-1/2 full parameters (their `.grad` under
ZeRO-1: views of the flat gradient buffer, of which only this rank's slice is averaged after backward;
under ZeRO-2/3: None, the gradients live in the slices). Use `full_state_dict()` for the truth.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from .. import comm
from ..runtime import env
from ..trace.events import phase
from . import check_options, consistency
from .flat import FlatBuffer
from .sharded import Shard, ShardedEngine, ShardedModel, compute_dtype
from .sharded_optimizer import ShardedOptimizer, check_optimizer
from .zero3 import Zero3  # stage 3 is its own idea, in its own file

OPTIONS = {
    1: ("mixed_precision", "group", "bucket_cap_mb", "reduce"),
    2: ("mixed_precision", "group", "bucket_cap_mb"),
    3: ("mixed_precision", "group", "prefetch_bucket_size", "reduce_bucket_size", "sub_group_size"),
}
REDUCE = ("reduce_scatter", "all_reduce")


def wrap_zero1(model: nn.Module, optimizer=torch.optim.AdamW, **options):
    """ZeRO stage 1: optimizer states partitioned. Returns (wrapped model, sharded optimizer)."""
    return _wrap(1, model, optimizer, options)


def wrap_zero2(model: nn.Module, optimizer=torch.optim.AdamW, **options):
    """ZeRO stage 2: optimizer states and gradients partitioned."""
    return _wrap(2, model, optimizer, options)


def wrap_zero3(model: nn.Module, optimizer=torch.optim.AdamW, **options):
    """ZeRO stage 3: optimizer states, gradients and parameters partitioned."""
    return _wrap(3, model, optimizer, options)


def _wrap(stage: int, model: nn.Module, optimizer, options: dict):
    name = f"zero{stage}"
    check_options(name, options, OPTIONS[stage])  # every mistake is reported before any collective
    check_optimizer(name, optimizer)
    dtype = compute_dtype(options.get("mixed_precision", False))
    reduce = options.get("reduce", "reduce_scatter")
    if reduce not in REDUCE:
        raise ValueError(f"{name}: reduce={reduce!r}; choose one of {REDUCE}.")
    cap = options.get("bucket_cap_mb", 25)
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0:
        raise ValueError(f"{name}: bucket_cap_mb must be a positive number of MiB, got {cap!r}.")
    buckets = {}
    for key in ("prefetch_bucket_size", "reduce_bucket_size", "sub_group_size"):  # stage 3 only (check_options)
        value = buckets[key] = options.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"{name}: {key} is a number of elements (an int >= 0; 0 = one module at a time), got {value!r}."
            )
    if not torch.distributed.is_initialized():
        raise RuntimeError(
            f"{name} shards over ranks, so it needs torch.distributed initialized: run it "
            "inside toolkit.launch(fn, world_size) (world_size=1 works too), or call "
            "toolkit.runtime.init() under torchrun or mpirun."
        )
    group = options.get("group")
    consistency.reject_experts(model, name)
    consistency.check_same_model(model, group)  # a clear error now rather than a hang later
    model.to(env.device())
    with phase("setup"):  # every rank starts from rank 0's values
        consistency.broadcast_from_rank0([*model.parameters(), *model.buffers()], group)
    if stage == 3:
        engine = Zero3(model, dtype, group, **buckets)
    else:
        engine = Zero12(model, stage, dtype, group, reduce, cap * 2**20)
    # The user's optimizer, built on this rank's fp32 slices only: that is the stage-1 saving.
    engine.optimizer = ShardedOptimizer(optimizer([s.master for s in engine.shards()]), engine)
    return ShardedModel(model, engine), engine.optimizer


# --- stages 1 and 2 ---------------------------------------------------------------------------------
class Bucket:
    """Consecutive parameters flattened into one padded buffer; the model's parameters become views of it.

    Rank r owns slice r of the bucket (`mine`): its fp32 master, its optimizer states and its averaged
    gradient. ZeRO-1 also keeps `grads`, a flat buffer of full gradients whose views are the `p.grad`;
    under ZeRO-2 `grads` exists only while the bucket's gradients arrive during backward.
    """

    def __init__(self, engine: Zero12, params: list):
        self.params, self.index = params, {p: i for i, p in enumerate(params)}
        self.flat, master = engine.flatten(params)
        for p, view in zip(params, self.flat.views()):
            p.data = view
        self.mine = Shard(master)
        self.grads: FlatBuffer | None = None
        self.waiting = len(params)  # ZeRO-2: gradients not yet arrived in this backward

    def new_grads(self) -> FlatBuffer:
        return FlatBuffer(
            self.flat.shapes, self.flat.world_size, dtype=self.flat.data.dtype, device=self.flat.data.device
        )

    def bind_grads(self) -> None:
        """ZeRO-1: make every p.grad a view of the flat gradient buffer (autograd then adds into it)."""
        for p, view in zip(self.params, self.grads.views()):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():  # someone replaced it (module.zero_grad())
                view.copy_(p.grad)
            p.grad = view


class Zero12(ShardedEngine):
    """ZeRO-1 and ZeRO-2: full parameters for compute; optimizer states (ZeRO-2: and gradients) sliced."""

    def __init__(self, module, stage: int, dtype, group, reduce: str, bucket_bytes: float):
        super().__init__(module, dtype, group)
        self.stage, self.name, self.reduce = stage, f"zero{stage}", reduce
        self.pieces = [Bucket(self, ps) for ps in self._bucket_params(bucket_bytes)]
        self.bucket_of = {p: b for b in self.pieces for p in b.params}
        self.in_flight = []  # ZeRO-2: (bucket, handle, output, input) of launched reduce-scatters
        self.skip_reduce = False  # ZeRO-1, inside no_sync()
        self.reduced = False  # ZeRO-1: this step's gradients are already reduced
        self.unreduced_backward = False  # ZeRO-1: a backward ran inside no_sync() since the last reduce
        if stage == 1:
            for b in self.pieces:
                b.grads = b.new_grads()
                b.bind_grads()
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._gradient_ready)

    def _bucket_params(self, bucket_bytes: float) -> list[list]:
        """Reverse parameter order (roughly the order backward produces gradients), cut every bucket_bytes."""
        buckets, current, size = [], [], 0
        for p in reversed(self.params):
            current.append(p)
            size += p.numel() * torch.finfo(self.dtype).bits // 8
            if size >= bucket_bytes:
                buckets.append(current)
                current, size = [], 0
        return buckets + ([current] if current else [])

    # --- backward ----------------------------------------------------------------------------------
    def _gradient_ready(self, p: nn.Parameter) -> None:
        """Hook: autograd has just finished p.grad for this backward."""
        if self.stage == 1:  # full gradients stay where they are; reduce them all once backward is over
            if self.skip_reduce:
                self.unreduced_backward = True
            else:
                self.queue_end_of_backward()
            return
        # ZeRO-2: copy the gradient into its bucket, free it, and reduce the bucket once it is complete.
        self.queue_end_of_backward()
        b = self.bucket_of[p]
        if b.grads is None:
            b.grads = b.new_grads()
        b.grads.view(b.index[p]).copy_(p.grad)
        p.grad = None  # the full gradient is gone; only the bucket holds it until it is reduced
        b.waiting -= 1
        if b.waiting == 0:
            self._reduce_scatter(b)

    def _reduce_scatter(self, b: Bucket) -> None:
        """ZeRO-2: average the bucket over the ranks, rank r receiving slice r, while backward goes on."""
        out = torch.empty(b.flat.shard_numel, dtype=self.dtype, device=b.grads.data.device)
        self._settle()  # the previous bucket's reduction is done by now: free its full gradient first
        handle = comm.reduce_scatter(out, b.grads.data, op="avg", group=self.group, async_op=True)
        self.in_flight.append((b, handle, out, b.grads))
        b.grads = None

    def _settle(self) -> None:
        """Wait for the launched reduce-scatters, add each result into its slice, and drop its input.

        Called before each new reduction, so at most one bucket's full gradient is in flight (as in
        torch FSDP): holding every bucket until the end of backward would keep the whole model's
        gradients alive at the peak, which is what ZeRO-2 exists to avoid.
        """
        for b, handle, out, _ in self.in_flight:
            handle.wait()
            b.mine.grad = out if b.mine.grad is None else b.mine.grad.add_(out)
        self.in_flight = []

    def end_of_backward(self) -> None:
        if self.stage == 1:
            self._reduce_full_gradients()
            return
        for b in self.pieces:  # a bucket some of whose parameters got no gradient this time
            if b.grads is not None:
                self._reduce_scatter(b)
            b.waiting = len(b.params)
        self._settle()

    def _reduce_full_gradients(self) -> None:
        """ZeRO-1, once backward is over: each rank gets the averaged gradient of its slice."""
        if self.reduced:
            raise RuntimeError(
                "zero1 already reduced this step's gradients: call optimizer.zero_grad() after each step, "
                "and to accumulate micro-batches run every backward but the last inside model.no_sync()."
            )
        for b in self.pieces:
            b.bind_grads()
            mine = b.grads.shard(self.rank)
            if self.reduce == "reduce_scatter":
                out = torch.empty_like(mine)
                comm.reduce_scatter(out, b.grads.data, op="avg", group=self.group)
                mine.copy_(out)  # my slice is now the average; the rest still holds my local gradient
            else:
                comm.all_reduce(b.grads.data, op="avg", group=self.group)  # everyone gets everything
            b.mine.grad = mine
        self.reduced, self.unreduced_backward = True, False

    def no_sync(self):
        return self._skip_reduce() if self.stage == 1 else super().no_sync()

    @contextlib.contextmanager
    def _skip_reduce(self):
        """ZeRO-1: backwards inside only accumulate into the full local gradients (no communication)."""
        self.skip_reduce = True
        try:
            yield
        finally:
            self.skip_reduce = False

    # --- step ----------------------------------------------------------------------------------------
    def before_step(self) -> None:
        if self.stage == 1 and self.unreduced_backward and not self.reduced:
            raise RuntimeError(
                "zero1: the last backward ran inside model.no_sync(), so no gradient was "
                "reduced; run the final micro-batch's backward outside no_sync() before step()."
            )

    @torch.no_grad()
    def after_step(self) -> None:
        """Every rank updated its slice; all-gather the slices so that every rank has the new parameters."""
        for b in self.pieces:
            mine = b.mine.master.detach().to(self.dtype, copy=True)  # (16-bit) copy of my new slice
            comm.all_gather(b.flat.data, mine, group=self.group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.stage == 1:  # the full gradient buffer stays allocated: it is ZeRO-1's 2Ψ (or 4Ψ)
            for b in self.pieces:
                b.grads.data.zero_()
                b.bind_grads()
                b.mine.grad = None
        else:
            super().zero_grad(set_to_none)
        self.reduced = self.unreduced_backward = False

    def memory_groups(self) -> dict:
        grads = [b.grads.data for b in self.pieces if b.grads is not None]
        grads += [b.mine.grad for b in self.pieces if b.mine.grad is not None]
        grads += [t[3].data for t in self.in_flight] + [p.grad for p in self.params if p.grad is not None]
        return {
            "params": [b.flat.data for b in self.pieces] + self.frozen,
            "grads": grads,
            "optimizer": self.optimizer_tensors(),
        }
