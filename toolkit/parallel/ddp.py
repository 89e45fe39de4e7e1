"""Data parallelism: every rank holds the whole model and computes gradients on its own slice of the
batch; averaging the gradients over the ranks makes every rank take the step that one process would
take on the whole batch.

Two versions, in the order a course builds them:

- "dp" (`wrap_naive`): once backward is over, all-reduce every gradient, one message per tensor.
  Correct, and slow: the network idles during backward, then many small messages each pay the latency.
- "ddp" (`wrap`): torch DDP's design. Gradients are grouped into buckets of about `bucket_cap_mb`
  MiB, last-registered parameters first (roughly the order backward produces them). A hook on each
  parameter marks its gradient ready and copies it, divided by N, into its bucket's flat buffer (as
  torch's reducer: summing N fp16 gradients first could overflow 65504 where their average fits); a
  complete bucket's all-reduce (a sum) starts asynchronously, while backward goes on computing
  earlier layers. At the end of backward we wait for every bucket and point each `.grad` at its slice
  of the bucket (torch's `gradient_as_bucket_view=True`), so after backward the gradients take Ψ·bytes
  once, as the (2+2+K)Ψ accounting says, not once in `.grad` and again in the buckets.
  Two refinements of torch's: with the default cap the *first* bucket closes at 1 MiB (the last
  layers' gradients leave early instead of waiting for 25 MiB to fill; an explicit `bucket_cap_mb`
  applies to every bucket, as in torch); and registration order is only a guess, so the first
  backward records the order in which gradients really became ready, and the next forward rebuilds
  the buckets in that order (rank 0's order, broadcast, so that every rank's buckets match).
  torch has that 1 MiB first bucket only after its rebuild: its first iteration puts every gradient in
  one bucket (or, with find_unused_parameters=True, which never rebuilds, makes the 1 MiB bucket of the
  first-registered parameters, reduced last); here the reverse-order buckets start with it.

What both share: at wrap time the ranks' models are checked to be the same and rank 0's parameters and
buffers are broadcast; `no_sync()` for gradient accumulation; `mixed_precision` (see local.py: 16-bit
parameters, gradients and messages, fp32 masters in the optimizer). Corner cases:

- requires_grad=False parameters are never reduced (as in torch). Buffers are broadcast once, at
  wrap time (torch re-broadcasts them before every forward, which matters for BatchNorm statistics).
- a tied parameter (the GPT's embedding and head) is one Parameter: autograd sums both uses before
  accumulating, so its hook fires once per backward and it is reduced once.
- a parameter that gets no gradient in a backward (unused in that forward) contributes zeros, so a
  layer skipped on some ranks still averages right (torch's `find_unused_parameters=True`; torch's
  default raises instead). A parameter that no rank used ends with a zero gradient where "local"
  would leave None (AdamW then still decays it): freeze it with `requires_grad_(False)`.
- expert parameters (tagged `param._toolkit_expert` by toolkit.moe) differ per rank: they are neither
  broadcast nor all-reduced; the MoE all-to-all backward already summed every rank's contribution, so
  they are only divided by the group size (the average the dense gradients get). When the experts are split
  over fewer ranks than the group and copied over the rest (`expert_group`: the expert-data-parallel ranks,
  `toolkit/parallel/expert_layout.py`), the copies' sums are first all-reduced over that group.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from .. import comm
from ..comm.average import divide_factors
from ..runtime import env
from ..trace.events import phase
from . import check_options, consistency
from .local import Wrapped
from .refusals import refuse_frozen_since_wrap

NAIVE_OPTIONS = ("mixed_precision", "group", "expert_group")
DDP_OPTIONS = ("mixed_precision", "bucket_cap_mb", "group", "expert_group")


class DataParallel(Wrapped):
    """What both versions share: the same start on every rank, and noticing when a backward runs."""

    def __init__(self, module, mixed_precision=False, group=None, expert_group=None):
        consistency.check_same_model(module, group)  # a clear error now rather than a hang later
        module.to(env.device())
        with phase("setup"):
            dense = [p for p in module.parameters() if not getattr(p, "_toolkit_expert", False)]
            consistency.broadcast_from_rank0(dense + list(module.buffers()), group)  # experts differ per rank
            experts = [p for p in module.parameters() if getattr(p, "_toolkit_expert", False)]
            if expert_group is not None:  # ... and are the same on their copies (Megatron broadcasts them too)
                consistency.broadcast_from_rank0(experts, expert_group)
        super().__init__(module, mixed_precision)  # fp32 masters copy rank 0's values, then the cast
        self.group, self.expert_group = group, expert_group
        self.params = [p for p in dense if p.requires_grad]  # tied ones appear once
        self.experts = experts
        copy = comm.group_ranks(expert_group).index(torch.distributed.get_rank()) if expert_group is not None else 0
        for p in self.experts:  # averaged here over N; in fp16 toolkit.moe divides by `pre` before its sums
            p._toolkit_grad_average = len(comm.group_ranks(group))
            p._toolkit_expert_copy = copy  # which copy of the expert (a norm counts copy 0 only: tensor/clip.py)
        if self.scaler is not None:  # fp16: replicas hold the same averaged gradients, experts their own
            self.scaler.group, self.scaler.across_ranks = group, bool(self.experts)
        self.require_sync = True  # no_sync() turns it off
        self._sync = True  # what the last forward saw: torch decides at forward time too
        self._in_backward = False
        for index, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, index))

    @contextlib.contextmanager
    def no_sync(self):
        """Forwards and backwards inside only accumulate local gradients; the next synchronised
        backward then reduces the accumulated sum, so k micro-batches cost one reduction."""
        before, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = before

    @contextlib.contextmanager
    def sync_backward(self, sync: bool):
        """Backwards inside reduce (sync=True) or only accumulate, whatever their forward decided. For a
        pipeline's schedule (`toolkit.parallel.pipeline`), where the forwards and backwards of micro-batches
        interleave, so no forward knows whether its backward is the step's last (torch's pipelining reaches
        into its DDP's reducer for the same reason)."""
        before, self._sync = self._sync, sync
        try:
            yield
        finally:
            self._sync = before

    def forward(self, *args, **kwargs):
        self._sync, self._in_backward = self.require_sync, False
        return super().forward(*args, **kwargs)

    def _on_grad(self, index, param):
        """Autograd calls this once per parameter per backward, right after `.grad` is accumulated."""
        if not self._sync:
            return
        if not self._in_backward:  # the first gradient of this backward: be called back at its end
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self.grad_ready(index)

    def _end_of_backward(self):
        self._in_backward = False
        refuse_frozen_since_wrap(self.module, self.params)
        for p in self.experts:  # MoE all-to-all backward already summed every rank's part: average
            if self.expert_group is not None:  # the copies' sums added up (every copy joins, as in dp's)
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad
                comm.all_reduce(p.grad, group=self.expert_group)
            if p.grad is not None:  # by what the sums have not divided already (fp16: moe/experts.py)
                p.grad.div_(divide_factors(len(comm.group_ranks(self.group)), p.grad.dtype)[1])
        self.finish_backward()

    def grad_ready(self, index: int) -> None:
        """Parameter `index`'s gradient is final for this backward."""

    def finish_backward(self) -> None:
        """Backward is over: every rank must now hold the averaged gradients."""
        raise NotImplementedError


# --- 1. naive data parallel ---------------------------------------------------------------------
class NaiveDataParallel(DataParallel):
    """ "dp": when backward is over, average every gradient with its own blocking all-reduce.

    Why at the end of backward rather than at the start of `optimizer.step()`: whatever runs between
    backward and step (clip_grad_norm_, logging the gradient norm) sees averaged gradients, exactly as
    under DDP; the two versions then differ only in when and how the bytes travel.
    """

    def finish_backward(self):
        for p in self.params:
            if p.grad is None:  # unused in this forward here: it still joins, or the ranks' calls mismatch
                p.grad = torch.zeros_like(p)
            comm.all_reduce(p.grad, op="avg", group=self.group)


# --- 2. bucketed, overlapped DDP -----------------------------------------------------------------
FIRST_BUCKET_BYTES = 2**20  # torch's dist._DEFAULT_FIRST_BUCKET_BYTES


def assign_buckets(params, cap_bytes: float, first_cap_bytes: float | None = None, order=None) -> list[list[int]]:
    """Indices of `params` in buckets, in `order` (default: last-registered first). A bucket closes
    once it holds at least `cap_bytes` (the first bucket: `first_cap_bytes`, default the same), so a
    parameter larger than the cap gets a bucket of its own, or when the dtype changes."""
    order = reversed(range(len(params))) if order is None else order
    buckets, current, size = [], [], 0
    for i in order:
        p = params[i]
        limit = cap_bytes if buckets or first_cap_bytes is None else first_cap_bytes
        if current and (size >= limit or p.dtype != params[current[0]].dtype):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += p.numel() * p.element_size()
    return buckets + [current] if current else buckets


class Bucket:
    """Some parameters' gradients side by side in one flat buffer: one all-reduce carries them all."""

    def __init__(self, params, indices):
        mine = [params[i] for i in indices]
        self.indices = indices
        self.buffer = torch.zeros(sum(p.numel() for p in mine), dtype=mine[0].dtype, device=mine[0].device)
        self.views = dict(zip(indices, self.buffer.split([p.numel() for p in mine])))  # index -> slice
        self.ready: set[int] = set()
        self.handle = None

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.indices)


class DistributedDataParallel(DataParallel):
    """ "ddp": buckets of gradients all-reduced asynchronously while backward goes on."""

    def __init__(self, module, mixed_precision=False, bucket_cap_mb=None, group=None, expert_group=None):
        super().__init__(module, mixed_precision, group, expert_group)
        # torch's rule: the default cap (25 MiB) comes with a 1 MiB first bucket; a cap you choose is every bucket's
        self.caps = (FIRST_BUCKET_BYTES, 25 * 2**20) if bucket_cap_mb is None else (bucket_cap_mb * 2**20,) * 2
        self._build(assign_buckets(self.params, self.caps[1], self.caps[0]))
        self.ready_order: list[int] | None = []  # the first backward's order; None once rebuilt

    def _build(self, assignment) -> None:
        self.buckets = [Bucket(self.params, ix) for ix in assignment]
        self.bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket.indices}
        self.next_bucket = 0  # buckets start in order, so every rank issues the same collectives

    def forward(self, *args, **kwargs):
        if self.ready_order:  # a backward has run: rebuild once, before the next backward needs buckets
            self._rebuild_buckets()
        return super().forward(*args, **kwargs)

    @torch.no_grad()
    def _rebuild_buckets(self) -> None:
        """Buckets in the order the first backward made gradients ready (rank 0's, so all ranks agree);
        parameters that got no gradient then follow, last-registered first."""
        order = self.ready_order + [i for i in reversed(range(len(self.params))) if i not in self.ready_order]
        agreed = torch.tensor(order, device=self.buckets[0].buffer.device)
        comm.broadcast(agreed, src=comm.group_ranks(self.group)[0], group=self.group)
        self.ready_order = None
        order = order if agreed.is_meta else agreed.tolist()  # meta tensors (a simulation) hold no values
        self._build(assign_buckets(self.params, self.caps[1], self.caps[0], order=order))
        for bucket in self.buckets:  # gradients kept from before (zero_grad(set_to_none=False)) move along
            for index, view in bucket.views.items():
                p = self.params[index]
                if p.grad is not None:
                    view.copy_(p.grad.reshape(-1))
                    p.grad = view.view_as(p)

    def grad_ready(self, index):
        if self.ready_order is not None:
            self.ready_order.append(index)
        bucket = self.buckets[self.bucket_of[index]]
        if index in bucket.ready:
            raise RuntimeError(
                f"parameter #{index} became ready twice in one backward; DDP reduces each "
                "gradient once per backward (reentrant checkpointing can cause this)."
            )
        # divide while copying into the bucket, then sum (torch's reducer): N fp16 gradients that fit
        # still fit once summed, where a sum first could overflow 65504 (comm/average.py)
        torch.mul(self.params[index].grad.reshape(-1), 1.0 / len(comm.group_ranks(self.group)), out=bucket.views[index])
        bucket.ready.add(index)
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].complete:
            self._launch(self.buckets[self.next_bucket])

    def _launch(self, bucket):
        for index, view in bucket.views.items():
            if index not in bucket.ready:  # no gradient in this backward: contribute zeros
                view.zero_()
        bucket.handle = comm.all_reduce(bucket.buffer, op="sum", group=self.group, async_op=True)  # pre-divided
        self.next_bucket += 1

    def finish_backward(self):
        while self.next_bucket < len(self.buckets):  # buckets still waiting on an unused parameter
            self._launch(self.buckets[self.next_bucket])
        for bucket in self.buckets:
            bucket.handle.wait()
            for index, view in bucket.views.items():  # gradients become views of the bucket: no copy,
                self.params[index].grad = view.view_as(self.params[index])  # and 2Ψ of grads, not 3Ψ
            bucket.ready.clear()
            bucket.handle = None
        self.next_bucket = 0

    def memory_groups(self):
        """As every strategy's, plus the bucket buffers, which count as gradients."""
        groups = super().memory_groups()
        groups["grads"] = groups["grads"] + [b.buffer for b in self.buckets]
        return groups


# --- the strategies' entry points ----------------------------------------------------------------
def wrap_naive(model, optimizer, **options):
    """ "dp": one all-reduce per gradient after backward. Options: mixed_precision, group (the ranks to
    average over; default every rank)."""
    check_options("dp", options, NAIVE_OPTIONS)
    wrapped = NaiveDataParallel(model, **options)
    return wrapped, wrapped.build_optimizer(optimizer)


def wrap(model, optimizer, **options):
    """ "ddp": bucketed all-reduces overlapped with backward. Options: mixed_precision, bucket_cap_mb
    (default 25, with a 1 MiB first bucket; a cap given applies to every bucket), group (default every rank)."""
    check_options("ddp", options, DDP_OPTIONS)
    cap = options.get("bucket_cap_mb", 25)
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0:
        raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {cap!r}.")
    wrapped = DistributedDataParallel(model, **options)
    return wrapped, wrapped.build_optimizer(optimizer)
