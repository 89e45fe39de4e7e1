"""ZeRO stages 1 and 2: full parameters for compute; the optimizer states (ZeRO-2: and the gradients) in slices.

The parameters are cut into buckets, in reverse order (roughly the order backward produces their
gradients), each flattened into one padded buffer (`flat.py`) whose slice r this rank owns. One step:

ZeRO-1  backward fills the full gradients (views of each bucket's flat gradient buffer) -> when backward
        is over, reduce-scatter every bucket (rank r receives the average of slice r) -> the optimizer
        steps slice r in fp32 -> all-gather the updated slices back into the full parameters.
ZeRO-2  each bucket is reduce-scattered *during* backward, as soon as its last gradient arrives, and
        its full gradients are freed at once: only the slice stays (`_settle` keeps one in flight).

With `reduce_dtype=torch.float32` (16-bit compute) the gradients are reduced in fp32: each backward's 16-bit `p.grad`
is added into an fp32 buffer and dropped as soon as autograd has finished it, as Megatron-LM adds it into its
`main_grad` (and DeepSpeed's BF16_Optimizer into its fp32 gradients), so micro-batches accumulate in fp32 too.

Megatron-LM's distributed optimizer is ZeRO-1 with two overlaps (its own flags' names): `overlap_grad_reduce`, each
bucket reduce-scattered during backward as soon as it is complete (ZeRO-2's schedule, the full gradients kept), and
`overlap_param_gather`, the updated parameters all-gathered in the next forward (`param_gather.py`).

`zero.py` wraps a model in them (and says what every stage shares); stage 3 is `zero3.py`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from .. import comm
from .flat import FlatBuffer
from .grad_in_slices import is_placeholder, real_grads
from .param_gather import ParamGather
from .sharded import Shard, ShardedEngine


class Bucket:
    """Consecutive parameters flattened into one padded buffer; the model's parameters become views of it.

    Rank r owns slice r of the bucket (`mine`): its fp32 master, its optimizer states and its averaged
    gradient. ZeRO-1 also keeps `grads`, a flat buffer of full gradients whose views are the `p.grad`
    (in fp32 main gradients, which each `p.grad` is added into: `main`); under ZeRO-2 `grads` exists only
    while the bucket's gradients arrive during backward.
    """

    def __init__(self, engine: Zero12, params: list):
        self.params, self.index = params, {p: i for i, p in enumerate(params)}
        self.flat, master = engine.flatten(params)
        for p, view in zip(params, self.flat.views()):
            p.data = view
        self.mine = Shard(master)
        self.grads: FlatBuffer | None = None
        self.grad_dtype = engine.grad_dtype
        self.main = self.grad_dtype != self.flat.data.dtype  # fp32 main gradients: p.grad is added in, not a view
        self.waiting = len(params)  # ZeRO-2: gradients not yet arrived in this backward

    def new_grads(self) -> FlatBuffer:
        return FlatBuffer(self.flat.shapes, self.flat.world_size, dtype=self.grad_dtype, device=self.flat.data.device)

    def add_main_grad(self, p: nn.Parameter) -> None:
        """Main gradients: add this backward's 16-bit p.grad into its fp32 view, and free it."""
        self.grads.view(self.index[p]).add_(p.grad)
        p.grad = None

    def bind_grads(self) -> None:
        """ZeRO-1: make every p.grad a view of the flat gradient buffer (autograd then adds into it). Main
        gradients are in another dtype than p.grad can be: each p.grad is added into them instead."""
        if self.main:
            return
        for p, view in zip(self.params, self.grads.views()):
            if p.grad is None:
                view.zero_()
            elif not is_placeholder(p.grad) and p.grad.data_ptr() != view.data_ptr():  # replaced (module.zero_grad())
                view.copy_(p.grad)
            p.grad = view


class Zero12(ShardedEngine):
    """ZeRO-1 and ZeRO-2: full parameters for compute; optimizer states (ZeRO-2: and gradients) sliced."""

    def __init__(
        self,
        module,
        stage: int,
        dtype,
        group,
        reduce: str,
        bucket_bytes: float,
        overlap_grad_reduce: bool = False,
        overlap_param_gather: bool = False,
        grad_dtype=None,
    ):
        super().__init__(module, dtype, group)
        self.grad_dtype = grad_dtype or dtype  # the dtype gradients are accumulated and reduced in
        self.stage, self.name, self.reduce = stage, f"zero{stage}", reduce
        self.pieces = [Bucket(self, ps) for ps in self._bucket_params(bucket_bytes)]
        self.bucket_of = {p: b for b in self.pieces for p in b.params}
        self.in_flight = []  # (bucket, handle, output, input) of launched reductions (ZeRO-1: overlap_grad_reduce)
        self.overlap_grad_reduce = overlap_grad_reduce
        self.param_gather = ParamGather(self, module) if overlap_param_gather else None
        self.skip_reduce = False  # ZeRO-1, inside no_sync()
        self.reduced = False  # ZeRO-1: this step's gradients are already reduced
        self.unreduced_backward = False  # ZeRO-1: a backward ran inside no_sync() since the last reduce
        if stage == 1:
            for b in self.pieces:
                b.grads = b.new_grads()
                b.bind_grads()
        self.watch_gradients(self._gradient_ready)

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
        if self.stage == 1:  # full gradients stay where they are; reduce them once backward is over (or their bucket)
            if self.bucket_of[p].main:
                self.bucket_of[p].add_main_grad(p)
            if self.skip_reduce:
                self.unreduced_backward = True
                return
            self.queue_end_of_backward()
            if self.overlap_grad_reduce:
                b = self.bucket_of[p]
                b.waiting -= 1
                if b.waiting == 0:
                    self._reduce_full_bucket(b)
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
        out = torch.empty(b.flat.shard_numel, dtype=self.grad_dtype, device=b.grads.data.device)
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
        if self.stage == 1 and self.overlap_grad_reduce:
            for b in self.pieces:  # a bucket some of whose parameters got no gradient this time
                if b.waiting:
                    self._reduce_full_bucket(b)
                b.waiting = len(b.params)
            for b, handle, out, _ in self.in_flight:
                handle.wait()
                if out is not None:
                    b.mine.grad.copy_(out)
            self.in_flight = []
            self.reduced, self.unreduced_backward = True, False
            return
        if self.stage == 1:
            self._reduce_full_gradients()
            return
        for b in self.pieces:  # a bucket some of whose parameters got no gradient this time
            if b.grads is not None:
                self._reduce_scatter(b)
            b.waiting = len(b.params)
        self._settle()

    def _refuse_reducing_twice(self) -> None:
        if self.reduced:
            raise RuntimeError(
                "zero1 already reduced this step's gradients: call optimizer.zero_grad() after each step, "
                "and to accumulate micro-batches run every backward but the last inside model.no_sync()."
            )

    def _reduce_full_bucket(self, b: Bucket) -> None:
        """ZeRO-1 with overlap_grad_reduce: one bucket's full gradients reduced while backward goes on; its slice
        becomes the average when the end of backward waits for it."""
        self._refuse_reducing_twice()
        b.bind_grads()
        b.mine.grad = b.grads.shard(self.rank)
        if self.reduce == "reduce_scatter":
            out = torch.empty_like(b.mine.grad)
            handle = comm.reduce_scatter(out, b.grads.data, op="avg", group=self.group, async_op=True)
        else:
            out, handle = None, comm.all_reduce(b.grads.data, op="avg", group=self.group, async_op=True)
        self.in_flight.append((b, handle, out, None))

    def _reduce_full_gradients(self) -> None:
        """ZeRO-1, once backward is over: each rank gets the averaged gradient of its slice."""
        self._refuse_reducing_twice()
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
        if self.param_gather is not None:
            self.param_gather.finish_in_flight()  # before the slices change

    @torch.no_grad()
    def after_step(self) -> None:
        """Every rank updated its slice; all-gather the slices so that every rank has the new parameters (with
        overlap_param_gather: when the next forward needs them)."""
        if self.param_gather is not None:
            self.param_gather.all_stale()
            return
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
        grads += [t[3].data for t in self.in_flight] + real_grads(self.params)
        return {
            "params": [b.flat.data for b in self.pieces] + self.frozen,
            "grads": grads,
            "optimizer": self.optimizer_tensors(),
        }
