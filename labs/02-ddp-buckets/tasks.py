"""What every rank runs for lab 02's checks, next to your code: it builds the tiny GPT from the seed the
grader sent, wraps it in your BucketedDDP, trains on this rank's rows, and returns what happened (gradients,
parameters, your buckets, the collectives the trace recorded). The grader's process judges it (checks.py)."""

import torch

from toolkit.comm import collectives
from toolkit.models import tiny_gpt
from toolkit.run import Run
from toolkit.trace.analysis import overlap_fraction
from toolkit.trace.events import recorder

CAP_MB = 0.01  # about 10 KB: the tiny GPT's gradients fill several buckets


def _model(given):
    torch.manual_seed(given["seed"])
    return tiny_gpt()


def _step(ddp, batch):
    x, y = batch
    ddp(x, y).backward()


def _all_reduces() -> int:
    return sum(1 for e in recorder.events if e["cat"] == "comm" and e["name"] == "all_reduce")


def bucket_assignment(student, rank, given):
    return {"buckets": student.assign_buckets([torch.zeros(e) for e in given["elements"]], given["cap"])}


def buckets_of_the_model(student, rank, given):
    ddp = student.BucketedDDP(_model(given), bucket_cap_mb=CAP_MB, group=rank.group)
    return {"buckets": [list(b.indices) for b in ddp.buckets], "buffers": [b.buffer.numel() for b in ddp.buckets]}


def averaged_gradients(student, rank, given):
    model = _model(given)
    ddp = student.BucketedDDP(model, bucket_cap_mb=CAP_MB, group=rank.group)
    _step(ddp, given["batches"][0])
    return {"grads": {name: p.grad for name, p in model.named_parameters()}}


def parity_with_local(student, rank, given):
    model = _model(given)
    ddp = student.BucketedDDP(model, bucket_cap_mb=CAP_MB, group=rank.group)
    opt = torch.optim.SGD(ddp.parameters(), **given["optimizer"])
    for batch in given["batches"]:
        _step(ddp, batch)
        opt.step()
        opt.zero_grad()
    return {"params": {name: p.detach() for name, p in model.named_parameters()}}


def overlap(student, rank, given):
    """The order of events in one backward: each gradient made final ("ready") and each wait on a handle,
    with how many all-reduces had started by then; whether each all-reduce was asynchronous; the overlap."""
    model = _model(given)
    log = []
    for p in model.parameters():  # registered before the student's: runs first, as the gradient is final
        p.register_post_accumulate_grad_hook(lambda _p: log.append(("ready", _all_reduces())))
    ddp = student.BucketedDDP(model, bucket_cap_mb=CAP_MB, group=rank.group)
    real_wait = collectives.Handle.wait

    def watched_wait(handle):
        log.append(("wait", _all_reduces()))
        return real_wait(handle)

    recorder.reset()
    collectives.Handle.wait = watched_wait
    try:
        with recorder.span("backward"):
            _step(ddp, given["batches"][0])
    finally:
        collectives.Handle.wait = real_wait
    calls = [e for e in rank.local_events() if e["name"] == "all_reduce"]  # async_op: the rank's own word
    return {
        "log": log,
        "async": [bool(e["args"].get("async_op")) for e in calls],
        "buckets": len(ddp.buckets),
        "overlap": overlap_fraction(Run.capture(align=False), rank.rank) if calls else 0.0,
    }


class _OneLayerUnused(torch.nn.Module):
    """Two linear layers, the second never used: its parameters (indices 2 and 3) get no gradient."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x).square().mean()


def unused_parameter(student, rank, given):
    torch.manual_seed(0)
    ddp = student.BucketedDDP(_OneLayerUnused(), bucket_cap_mb=given["cap_mb"], group=rank.group)
    try:
        ddp(given["x"]).backward()
    except Exception as exc:  # noqa: BLE001 - what the student raised, and what it says
        return {"raised": type(exc).__name__, "message": str(exc)[:500]}
    return {"raised": "", "message": ""}


def bytes_on_the_wire(student, rank, given):
    """The collectives of each backward of the plain training loop, one list per backward: a wrapper that is not
    put back as it was shows only from the second."""
    ddp = student.BucketedDDP(_model(given), bucket_cap_mb=CAP_MB, group=rank.group)
    opt = torch.optim.SGD(ddp.parameters(), **given["optimizer"])
    comms = []
    for batch in given["batches"]:
        start = rank.events_now()
        _step(ddp, batch)
        comms.append(rank.comm_events(start))
        opt.step()
        opt.zero_grad()
    return {"comms": comms}
