"""Lab 02, the reference solution: gradient buckets, all-reduced from gradient hooks while backward runs.

Self-contained on purpose (the lab stands alone); `toolkit/parallel/ddp.py` is the same design as the
toolkit's "ddp" strategy uses it (plus no_sync, mixed precision and unused parameters).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from toolkit import comm


# --- yours: which gradients travel together -----------------------------------------------------------
def assign_buckets(params: list[torch.Tensor], cap_bytes: float) -> list[list[int]]:
    """Group parameter indices into buckets of about `cap_bytes`, last-registered parameter first."""
    buckets, current, size = [], [], 0
    for index in reversed(range(len(params))):
        current.append(index)
        size += params[index].numel() * params[index].element_size()
        if size >= cap_bytes:  # full: close it; the next parameter opens a new one
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


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
        """Parameter `index`'s gradient is final: copy it into its bucket, and launch every complete bucket."""
        bucket = self.buckets[self.bucket_of[index]]
        bucket.views[index].copy_(self.params[index].grad.reshape(-1))
        bucket.ready.add(index)
        # Launch in bucket order, so every rank issues the same collectives in the same order.
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].complete:
            launch = self.buckets[self.next_bucket]
            launch.handle = comm.all_reduce(launch.buffer, op="avg", group=self.group, async_op=True)
            self.next_bucket += 1

    def finish_backward(self) -> None:
        """Backward is over: wait for every bucket's all-reduce and put the averages back into `.grad`."""
        if self.next_bucket != len(self.buckets):
            missing = [i for b in self.buckets[self.next_bucket :] for i in b.indices if i not in b.ready]
            raise RuntimeError(
                f"backward ended with parameters {missing} still without a gradient; "
                "this lab expects every parameter to be used in every forward."
            )
        for bucket in self.buckets:
            bucket.handle.wait()
            for index, view in bucket.views.items():
                self.params[index].grad.copy_(view.view_as(self.params[index]))
            bucket.ready.clear()
            bucket.handle = None
        self.next_bucket = 0
