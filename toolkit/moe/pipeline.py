"""Tutel's pipelined all-to-all: steps 4-6 in d chunks along the capacity, so traffic hides compute.

Tutel splits the dispatched (E, C, d_model) buffer along the capacity C into d chunks and runs, for
each chunk, all-to-all -> experts -> all-to-all back; chunk i+1's dispatch travels while chunk i's
experts compute, and chunk i's outputs travel back while chunk i+1 computes:

    link     A2A_0  A2A_1  A2A_2 ...                      (dispatch and combine take turns)
    experts         E_0    E_1   E_2 ...

Small d does not overlap much; large d pays per-chunk overheads (latency of every extra message,
small matrix products). So Tutel chooses d at run time: ``pipeline_degree="auto"`` tries each d in
(1, 2, 4, 8) once per capacity bucket (the paper's dictionary, keyed by floor(C / 128)), keeps the
fastest, and uses it from then on. Every choice is recorded in the Run as ``moe/{name}/pipeline``
(see ``record``), and the dictionary is ``layer.pipeline_choices``.

Which capacity. In this layer only kept rows travel (uneven all-to-alls, no padding), so the slots
past the fullest expert's last row are empty everywhere. The chunks split the *occupied* capacity
C_occ = the largest number of rows any rank keeps for any expert (an all-reduce MAX, so every rank
cuts at the same slots: a sender and a receiver must agree which rows form chunk i). It equals the
capacity in dropless mode or when some expert is full, and it is what Tutel's dynamic capacity uses.
Chunk i holds slots [i*c, (i+1)*c) of every expert, c = ceil(C_occ / d).

A degree that does not divide the capacity is padded, not refused: the capacity is rounded up to
d*c slots, the padding holds no rows (nothing extra travels), so the last chunk is partly filled and
chunks past C_occ are empty on every rank and skipped. E.g. C_occ = 10, d = 3: chunks of 4, 4 and 2
slots; C_occ = 2, d = 8: two chunks of one slot. The record says so (``padded_slots``, ``chunks``) and
an explicit degree warns once per layer. The mathematics never changes: the same rows meet the same
experts; gradients run the same chunks in reverse (``toolkit.moe.units.Overlapped``).
"""

from __future__ import annotations

import math
import time
import warnings

import torch

from .. import comm
from ..trace.events import recorder
from .load import enclosing_step
from .units import Units, _Pending, label, overlapped

DEGREES = (1, 2, 4, 8)
BUCKET = 128  # the paper's dictionary key: floor(capacity / 128)


def chunking(capacity: int, degree: int) -> dict:
    """How ``capacity`` slots split into ``degree`` chunks: slots per chunk, chunks that hold rows,
    padded slots. ``chunking(10, 3)`` -> chunk_slots 4, chunks 3, padded_slots 2."""
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise ValueError(f"pipeline degree must be a positive int, got {degree!r}.")
    if capacity <= 0:
        return {"chunk_slots": 1, "chunks": 0, "padded_slots": 0}
    c = math.ceil(capacity / degree)
    return {"chunk_slots": c, "chunks": math.ceil(capacity / c), "padded_slots": c * degree - capacity}


class Chunks(Units):
    """Units = chunks along the capacity; each travels by one (uneven) all-to-all each way."""

    def __init__(self, layer, plan, chunk_slots: int, count: int, degree: int):
        self.layer, self.group, self.count, self.degree = layer, layer.group, count, degree
        self.plan_type = type(plan)
        c = chunk_slots
        flat = plan.send_counts.reshape(-1)
        starts = flat.cumsum(0) - flat
        position = torch.arange(int(flat.sum()), device=flat.device)
        slot = position - starts.repeat_interleave(flat)  # rows are sorted by (rank, expert, slot)
        chunk = torch.div(slot, c, rounding_mode="floor")
        self.index = [(chunk == k).nonzero().squeeze(1) for k in range(count)]
        self.send = [(plan.send_counts - k * c).clamp(0, c) for k in range(count)]
        self.recv = [(plan.recv_counts - k * c).clamp(0, c) for k in range(count)]
        self.send_splits = [s.sum(1).tolist() for s in self.send]
        self.recv_splits = [r.sum(1).tolist() for r in self.recv]

    def _tag(self, handle, what, k):
        return label(handle, f"{what} chunk {k + 1}/{self.degree}", self.layer.name)

    def post(self, x, k, names):
        out = x.new_empty((sum(self.recv_splits[k]),) + tuple(x.shape[1:]))
        handle = comm.all_to_all(
            out,
            x[self.index[k]].contiguous(),
            self.recv_splits[k],
            self.send_splits[k],
            group=self.group,
            async_op=True,
        )
        return _Pending(out, [self._tag(handle, names[0], k)])

    def block(self, k, received):
        return self.layer.compute_experts(received, self.plan_type(self.send[k], self.recv[k]))

    def post_back(self, k, y, names):
        back = y.new_empty((self.index[k].numel(),) + tuple(y.shape[1:]))
        handle = comm.all_to_all(
            back, y.contiguous(), self.send_splits[k], self.recv_splits[k], group=self.group, async_op=True
        )
        return _Pending(back, [self._tag(handle, names[1], k)])

    def assemble(self, results, like):
        out = like.new_zeros(like.shape)
        if results:
            out.index_copy_(0, torch.cat(self.index).to(out.device), torch.cat(results))  # CPU counts, meta rows (sim)
        return out


def occupied_capacity(layer, plan) -> int:
    """The largest number of rows any rank keeps for any expert: every rank cuts chunks at the same
    slots (an all-reduce MAX through the door, labelled "pipeline capacity")."""
    local = plan.send_counts.max() if plan.send_counts.numel() else plan.send_counts.new_zeros(())
    value = local.reshape(1).clone()
    label(comm.all_reduce(value, op="max", group=layer.group, async_op=True), "pipeline capacity", layer.name).wait()
    return int(value.item())


def _agree_on_time(layer, seconds: float) -> float:
    """The slowest rank's time: every rank must make the same choice."""
    value = torch.tensor([seconds], dtype=torch.float64)
    label(comm.all_reduce(value, op="max", group=layer.group, async_op=True), "pipeline auto timing", layer.name).wait()
    return float(value.item())


def choices(layer) -> dict:
    """``layer.pipeline_choices``: {bucket: {"times": {degree: seconds}, "best": degree or None}}."""
    if not isinstance(getattr(layer, "pipeline_choices", None), dict):
        layer.pipeline_choices = {}
    return layer.pipeline_choices


def record(layer, value: dict) -> None:
    """``moe/{name}/pipeline`` in the Run, one per pipelined forward: degree, capacity (occupied),
    bucket, chunk_slots, chunks, padded_slots, auto; when searching: trial=True and the (slowest
    rank's) seconds of this forward; once decided: best and the times of every degree tried."""
    recorder.metric(f"moe/{layer.name}/pipeline", value, step=enclosing_step())


def pipelined_dispatch_compute_combine(layer, rows: torch.Tensor, plan, wrap=None) -> torch.Tensor:
    """Steps 4-6 of ``layer`` in ``layer.pipeline_degree`` chunks (an int, or "auto": search and remember);
    the contract of ``MoE.dispatch_compute_combine``."""
    capacity = occupied_capacity(layer, plan)
    auto = layer.pipeline_degree == "auto"
    bucket = capacity // BUCKET
    trial = False
    if auto:
        entry = choices(layer).setdefault(bucket, {"times": {}, "best": None})
        if entry["best"] is None:
            degree, trial = next(d for d in DEGREES if d not in entry["times"]), True
        else:
            degree = entry["best"]
    else:
        degree = int(layer.pipeline_degree)
    shape = chunking(capacity, degree)
    if shape["padded_slots"] and not auto and not getattr(layer, "_pipeline_padding_warned", False):
        layer._pipeline_padding_warned = True
        warnings.warn(
            f"MoE {layer.name!r}: pipeline_degree={degree} does not divide the occupied capacity "
            f"{capacity}: padded to {degree * shape['chunk_slots']} slots ({shape['chunks']} chunk(s) of "
            f"{shape['chunk_slots']} slot(s) hold rows; padding carries nothing). The result is unchanged.",
            stacklevel=3,
        )
    units = Chunks(layer, plan, shape["chunk_slots"], shape["chunks"], degree)
    start = time.perf_counter()
    out = overlapped(wrap(units) if wrap else units, rows, layer)
    value = {"degree": degree, "capacity": capacity, "bucket": bucket, **shape, "auto": auto}
    if trial:
        seconds = _agree_on_time(layer, time.perf_counter() - start)
        entry["times"][degree] = seconds
        value.update(trial=True, seconds=seconds)
        if len(entry["times"]) == len(DEGREES):
            entry["best"] = min(DEGREES, key=lambda d: (entry["times"][d], d))
            value.update(best=entry["best"], times=dict(entry["times"]))
    record(layer, value)
    return out
