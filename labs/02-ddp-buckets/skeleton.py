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
    """Group parameter indices into buckets of about `cap_bytes`, last-registered parameter first. Returns a list of
    buckets, each a list of indices into `params`.

    What must hold: read in order, the buckets list every index once, from len(params) - 1 down to 0; a bucket is
    closed as soon as it holds at least `cap_bytes` bytes (a parameter's bytes: numel x element size), so a
    parameter larger than the cap gets a bucket of its own and only the last bucket may stay under the cap. Example:
    parameters of 100, 100 and 100 bytes with a cap of 150 bytes: [[2, 1], [0]].

    Why backwards: backward produces gradients roughly in reverse registration order (the output layer first, the
    embedding last), so the first bucket fills first and its all-reduce can start while backward goes on.
    """
    raise NotImplementedError("assign_buckets: not written yet")


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
        """Parameter `index`'s gradient is final (autograd calls this through `_hook`, once per parameter per backward,
        while backward goes on computing earlier layers' gradients).

        What must hold: the gradient is in its bucket's slice (`self.bucket_of[index]`, `bucket.views`) and marked
        ready; every bucket that is complete is travelling: its all-reduce through `toolkit.comm`, asynchronous (the
        handle kept on the bucket), averaging over the ranks (the whole batch's gradient is the mean of the ranks').
        Every rank must issue the same collectives in the same order, whatever order its own gradients arrive in
        (`self.next_bucket`, the first bucket not launched yet, is there for that). Nothing waits here: a wait would
        stall backward at every bucket, and nothing would overlap (the grader watches both).
        """
        raise NotImplementedError("grad_ready: not written yet")

    def finish_backward(self) -> None:
        """Backward is over (autograd calls this once, after the last gradient). Afterwards every parameter's `.grad`
        holds the average over the ranks, and the next backward finds the buckets and the wrapper as `__init__` left
        them (otherwise the next step can silently reuse this step's gradients). If a bucket was never launched, a
        parameter got no gradient in this backward: raise an error that says which.
        """
        raise NotImplementedError("finish_backward: not written yet")
