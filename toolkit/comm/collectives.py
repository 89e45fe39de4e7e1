"""The one door for every collective the toolkit issues: it records the call, then runs it.

Each call leaves a span on this rank's trace: operation, group, dtype, element count, message size,
bytes this rank sends and receives, and the phase. Then it runs either the backend's collective
(NCCL or gloo) or a hand-written one (`use("ring")`, or a student's functions: `switch.py`), so the
same training code can run on either and the trace shows which.

Bytes on the wire follow the algorithms the lessons teach (ring all-reduce sends 2(N-1)/N of the
message per rank, ring reduce-scatter and all-gather (N-1)/N); all-to-all and send/recv are exact.

Under `toolkit.comm.emulate(...)` every call here also books the emulated link (`comm/emulate.py`):
the data moves for real, then the call completes no sooner than the link's alpha-beta model says
(`Handle.wait` sleeps the remainder), and its span carries `args.emulated_s`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..runtime import status
from ..trace.events import recorder
from . import backend as _backend_impl
from . import emulate as _emulation
from . import switch as _switch
from .average import divide_around_sum
from .handle import Handle, explained
from .listeners import tell
from .switch import OPERATIONS, implementation, use, using  # noqa: F401 - re-exported: the switch

REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
    "avg": dist.ReduceOp.SUM,
}

_ranks_cache: dict = {}


# --- bookkeeping ----------------------------------------------------------------------------------
def group_ranks(group=None) -> list[int]:
    """Global ranks of a group (the default group when None)."""
    key = group if group is not None else "world"
    if key not in _ranks_cache:
        _ranks_cache[key] = dist.get_process_group_ranks(group or dist.group.WORLD)
    return _ranks_cache[key]


def _reduce_op(op):
    if isinstance(op, str):
        if op not in REDUCE_OPS:
            raise ValueError(f"op={op!r} is not a reduction; choose one of {sorted(REDUCE_OPS)}.")
        return REDUCE_OPS[op]
    return op


def _detail(event) -> str:
    a = event["args"]
    return f"phase '{event['phase']}', {a['numel']} x {a['dtype']}"


def _run(name, group, tensor, size_bytes, sent, received, call, async_op, after=None, link=None, **extra):
    """Record a span, run `call()` through the chosen implementation, close the span. ``link``: what
    the emulated link's model needs beyond the span's args (all_to_all's row sizes)."""
    event = recorder.add(
        name,
        "comm",
        recorder.mark(),
        group=group_ranks(group),
        dtype=str(tensor.dtype).replace("torch.", ""),
        numel=tensor.numel(),
        size_bytes=size_bytes,
        bytes_sent=sent,
        bytes_recv=received,
        impl=_switch.implementation(),
        async_op=async_op,
        **extra,
    )
    native = _switch.is_backend(name)
    booked = (
        None
        if _emulation._current is None
        else _emulation.book(name, event["args"]["group"], dist.get_rank(), size_bytes, dict(extra, **(link or {})))
    )
    if booked is not None:  # the emulated link's model for this call, marked on its span
        event["args"].update(booked[1])
    entry = status.begin(
        name,
        event["args"]["group"] if "peer" not in extra else sorted({dist.get_rank(), extra["peer"]}),
        _detail(event),
    )
    try:
        work = call(async_op and native)
    except BaseException as exc:
        status.fail(entry)
        if isinstance(exc, RuntimeError) and not isinstance(exc, NotImplementedError):
            raise explained(exc, entry) from exc
        raise  # a student's own error (an unfinished implementation, say): exactly as raised
    status.end(entry)
    tell("issue", event, tensor)
    handle = Handle(work if async_op and native else None, event, after, booked and booked[0], entry)
    if async_op:
        return handle
    handle.wait()
    return None


# --- the collectives ------------------------------------------------------------------------------
def all_reduce(tensor: torch.Tensor, op="sum", group=None, async_op=False):
    """Every rank ends with the reduction of everyone's `tensor` (in place). op="avg" divides by N
    (fp16: partly before the sum, `comm/average.py`)."""
    n = len(group_ranks(group))
    size = tensor.numel() * tensor.element_size()
    wire = 2 * (n - 1) * size // n
    reduce = _reduce_op(op)
    after = divide_around_sum(n, tensor, tensor) if op == "avg" else None
    return _run(
        "all_reduce",
        group,
        tensor,
        size,
        wire,
        wire,
        lambda a: _switch.function("all_reduce")(tensor, reduce, group, a),
        async_op,
        after,
        op=str(op),
    )


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op="sum", group=None, async_op=False):
    """Rank r ends with chunk r of the reduction of everyone's `input` (input = N x output elements).
    op="avg" divides by N; in fp16 part of it before the sum, in place on `input` (`comm/average.py`)."""
    n = len(group_ranks(group))
    if input.numel() != n * output.numel():
        raise ValueError(
            f"reduce_scatter needs input.numel() == group size x output.numel(): "
            f"{input.numel()} != {n} x {output.numel()}. Pad the input to a multiple of {n}."
        )
    size = input.numel() * input.element_size()
    wire = (n - 1) * size // n
    reduce = _reduce_op(op)
    after = divide_around_sum(n, input, output) if op == "avg" else None
    return _run(
        "reduce_scatter",
        group,
        input,
        size,
        wire,
        wire,
        lambda a: _switch.function("reduce_scatter")(output, input, reduce, group, a),
        async_op,
        after,
        op=str(op),
    )


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op=False):
    """Every rank ends with everyone's `input` concatenated in rank order (output = N x input elements)."""
    n = len(group_ranks(group))
    if output.numel() != n * input.numel():
        raise ValueError(
            f"all_gather needs output.numel() == group size x input.numel(): {output.numel()} != {n} x {input.numel()}."
        )
    size = output.numel() * output.element_size()
    wire = (n - 1) * size // n
    return _run(
        "all_gather",
        group,
        output,
        size,
        wire,
        wire,
        lambda a: _switch.function("all_gather")(output, input, group, a),
        async_op,
    )


def broadcast(tensor: torch.Tensor, src: int = 0, group=None, async_op=False):
    """Every rank ends with global rank `src`'s `tensor` (in place)."""
    size = tensor.numel() * tensor.element_size()
    me = dist.get_rank()
    return _run(
        "broadcast",
        group,
        tensor,
        size,
        size if me == src else 0,
        0 if me == src else size,
        lambda a: _switch.function("broadcast")(tensor, src, group, a),
        async_op,
        src=src,
    )


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes=None,
    input_split_sizes=None,
    group=None,
    async_op=False,
):
    """Rank r sends split j of its `input` (along dim 0) to rank j and receives split r of everyone's.

    Split sizes are rows along dim 0 and may be uneven; None means equal splits.
    """
    ranks = group_ranks(group)
    n, me = len(ranks), ranks.index(dist.get_rank())
    in_splits = list(input_split_sizes) if input_split_sizes is not None else [input.shape[0] // n] * n
    out_splits = list(output_split_sizes) if output_split_sizes is not None else [output.shape[0] // n] * n
    if len(in_splits) != n or len(out_splits) != n:
        raise ValueError(
            f"all_to_all needs one split size per rank of the group ({n}); got "
            f"{len(in_splits)} input and {len(out_splits)} output split sizes."
        )
    if sum(in_splits) != input.shape[0] or sum(out_splits) != output.shape[0]:
        raise ValueError(
            f"all_to_all split sizes must add up to dim 0: inputs {in_splits} vs {input.shape[0]}, "
            f"outputs {out_splits} vs {output.shape[0]}."
        )
    row_in = math.prod(input.shape[1:]) * input.element_size() if input.dim() else 0
    row_out = math.prod(output.shape[1:]) * output.element_size() if output.dim() else 0
    sent = (sum(in_splits) - in_splits[me]) * row_in
    received = (sum(out_splits) - out_splits[me]) * row_out
    size = input.numel() * input.element_size()
    return _run(
        "all_to_all",
        group,
        input,
        size,
        sent,
        received,
        lambda a: _switch.function("all_to_all")(output, input, out_splits, in_splits, group, a),
        async_op,
        link=dict(row_bytes=(row_in, row_out)),
        input_splits=in_splits,
        output_splits=out_splits,
    )


def send(tensor: torch.Tensor, dst: int, group=None):
    """Point-to-point: give `tensor` to global rank `dst` (blocks until it is taken)."""
    size = tensor.numel() * tensor.element_size()
    return _run(
        "send", group, tensor, size, size, 0, lambda a: _backend_impl.send(tensor, dst, group, a), False, peer=dst
    )


def recv(tensor: torch.Tensor, src: int, group=None):
    """Point-to-point: fill `tensor` from global rank `src`."""
    size = tensor.numel() * tensor.element_size()
    return _run(
        "recv", group, tensor, size, 0, size, lambda a: _backend_impl.recv(tensor, src, group, a), False, peer=src
    )


def isend(tensor: torch.Tensor, dst: int, group=None) -> Handle:
    size = tensor.numel() * tensor.element_size()
    return _run(
        "send", group, tensor, size, size, 0, lambda a: _backend_impl.send(tensor, dst, group, a), True, peer=dst
    )


def irecv(tensor: torch.Tensor, src: int, group=None) -> Handle:
    size = tensor.numel() * tensor.element_size()
    return _run(
        "recv", group, tensor, size, 0, size, lambda a: _backend_impl.recv(tensor, src, group, a), True, peer=src
    )


def barrier(group=None):
    """Wait until every rank of the group gets here (recorded, zero bytes)."""
    dummy = torch.zeros(1)
    return _run("barrier", group, dummy, 0, 0, 0, lambda a: dist.barrier(group=group, async_op=a), False)
