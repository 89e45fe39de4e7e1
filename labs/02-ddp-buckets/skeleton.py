"""Lab 02: DDP gradient buckets, all-reduced from gradient hooks while backward is still running.

Three pieces are yours (marked "yours" below): `assign_buckets`, `BucketedDDP.grad_ready` and
`BucketedDDP.finish_backward`. Everything else (the Bucket with its flat buffer, the wrapper, the hooks
that call you) is given. Read README.md first, then grade your work with

    python -m toolkit grade labs/02-ddp-buckets                     # grades this file
    python -m toolkit grade labs/02-ddp-buckets --solution my.py    # or a copy of it

Rule of the game: every collective goes through `toolkit.comm` (`comm.all_reduce(...)`), so the trace
records it and the grader can see when your buckets travelled and how many bytes they carried.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

from toolkit import comm


# --- yours: which gradients travel together -----------------------------------------------------------
def assign_buckets(params: list[torch.Tensor], cap_bytes: float) -> list[list[int]]:
    """Group parameter indices into buckets of about `cap_bytes`, last-registered parameter first.

    Returns a list of buckets, each a list of indices into `params`. Walk the parameters from the last
    (index len(params) - 1) to the first (index 0), adding each to the current bucket; as soon as the
    current bucket holds at least `cap_bytes` bytes, close it (the next parameter opens a new one). So a
    parameter larger than the cap gets a bucket of its own, and only the last bucket may stay under the
    cap. Read in order, the buckets list every index once: len(params) - 1, ..., 1, 0.

    Why backwards: backward produces gradients roughly in reverse registration order (the output layer
    first, the embedding last), so the first bucket fills first and its all-reduce can start early.

    Hints:
    - a parameter's bytes: `p.numel() * p.element_size()`
    - parameters of 100, 100 and 100 bytes with a cap of 150 bytes: [[2, 1], [0]]
    """
    raise NotImplementedError("assign_buckets: walk the parameters last to first, closing a bucket at the cap")


# --- given: a bucket is a flat buffer with a view per parameter ---------------------------------------
class Bucket:
    """Some parameters' gradients side by side in one flat buffer, so one all-reduce carries them all.

    indices: the parameters (positions in `BucketedDDP.params`) this bucket holds, in bucket order.
    buffer:  one flat tensor with room for all their gradients.
    views:   {parameter index: the slice of `buffer` that holds its gradient, flat}.
    ready:   the indices whose gradient has been copied in during this backward.
    handle:  what the asynchronous all-reduce of `buffer` returned (None until it is launched).
    """

    def __init__(self, params: list[torch.Tensor], indices: list[int]):
        mine = [params[i] for i in indices]
        self.indices = list(indices)
        self.buffer = torch.zeros(sum(p.numel() for p in mine), dtype=mine[0].dtype, device=mine[0].device)
        self.views = dict(zip(self.indices, self.buffer.split([p.numel() for p in mine])))
        self.ready: set[int] = set()
        self.handle = None

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.indices)


# --- given: the wrapper, its hooks and its buckets; yours: what the hooks do --------------------------
class BucketedDDP(nn.Module):
    """Data parallelism with gradient buckets whose all-reduces overlap backward.

    Wrap the same model on every rank; train with the plain loop
    `loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()` on each rank's own rows.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25, group=None):
        super().__init__()
        self.module, self.group = module, group
        self.params = [p for p in module.parameters() if p.requires_grad]  # a tied parameter appears once
        if len({p.dtype for p in self.params}) > 1:
            raise ValueError("this lab's buckets hold one dtype: give every parameter the same dtype.")
        with torch.no_grad():  # every rank starts from the first rank's values
            first = comm.group_ranks(group)[0]
            for t in list(module.parameters()) + list(module.buffers()):
                comm.broadcast(t.data, src=first, group=group)
        self.buckets = [Bucket(self.params, ix) for ix in assign_buckets(self.params, bucket_cap_mb * 2**20)]
        self.bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket.indices}
        self.next_bucket = 0  # the first bucket not launched yet in this backward
        self._in_backward = False
        for index, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(functools.partial(self._hook, index))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _hook(self, index: int, param: torch.Tensor) -> None:
        """Autograd calls this once per parameter per backward, right after `param.grad` is final."""
        if not self._in_backward:  # the first gradient of this backward: be called back at its very end
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self.grad_ready(index)

    def _end_of_backward(self) -> None:
        self._in_backward = False
        self.finish_backward()

    # --- yours ------------------------------------------------------------------------------------------
    def grad_ready(self, index: int) -> None:
        """Parameter `index`'s gradient is final: copy it into its bucket, and launch every complete bucket.

        Autograd calls this (through `_hook`) once per parameter per backward, while backward goes on
        computing the gradients of earlier layers.

        1. Find the bucket (`self.bucket_of[index]` is its position in `self.buckets`), copy the gradient
           into its slice, `bucket.views[index].copy_(self.params[index].grad.reshape(-1))`, and mark it
           ready (`bucket.ready`).
        2. Launch buckets in order: while the bucket at `self.next_bucket` is complete, start its
           all-reduce and move `next_bucket` on. Every rank must issue the same collectives in the same
           order; launching in bucket order guarantees it.
        3. Launching is `comm.all_reduce(bucket.buffer, op="avg", group=self.group, async_op=True)`: it
           returns at once with a handle (keep it in `bucket.handle`) while the bytes travel. op="avg"
           divides the sum by the number of ranks (when the handle is waited for), which turns the ranks'
           gradients into the gradient of the whole batch. Do not wait here: backward would stall at
           every bucket, and nothing would overlap.
        """
        raise NotImplementedError("grad_ready: copy the gradient into its bucket, launch complete buckets in order")

    def finish_backward(self) -> None:
        """Backward is over: wait for every bucket's all-reduce and put the averages back into `.grad`.

        Autograd calls this (through `_end_of_backward`) once, after the last gradient of the backward.

        1. Every bucket should have been launched by now (`self.next_bucket == len(self.buckets)`); if not,
           some parameter got no gradient in this backward: raise an error that says which.
        2. For each bucket: `bucket.handle.wait()` (the averaged gradients are then in `bucket.buffer`), and
           copy each parameter's slice back into its gradient: `p.grad.copy_(view.view_as(p))`.
        3. Reset for the next backward: empty every `bucket.ready`, clear the handles, `next_bucket = 0`.
        """
        raise NotImplementedError("finish_backward: wait for every bucket, copy the averages back into .grad")
