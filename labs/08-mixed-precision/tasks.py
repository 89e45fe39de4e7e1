"""What every rank runs for lab 08's checks, next to your code: the toolkit's tiny GPT (from the seed the grader
sent) under FSDP with your MixedUnit, on this rank's rows, and what was observed (the gathered flat parameters,
the dtypes that travelled, gradient slices, losses, parameters, bytes). The grader's process judges
(checks.py)."""

import functools

import torch

from toolkit.models import tiny_gpt
from toolkit.parallel.fsdp_unit import MixedPrecision

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _wrapped(student, given, precision=("bfloat16", None)):
    torch.manual_seed(given["seed"])
    param, reduce = precision
    mixed = MixedPrecision(DTYPES[param], DTYPES[reduce] if reduce else None)
    return student.wrap(
        tiny_gpt(), mixed_precision=mixed, optimizer=functools.partial(torch.optim.AdamW, **given["optimizer"])
    )


def gathered_in_bf16(student, rank, given):
    fsdp, _ = _wrapped(student, given)
    units = {}
    for unit in fsdp.units:
        start = rank.events_now()
        unit.unshard()
        units[unit.name] = {
            "gathered": rank.comm_events(start),  # what the grader's relay carried (checks.py reads the dtypes)
            "flat": unit.flat.data.detach().clone(),
            "master": str(unit.master.dtype),
        }
        unit.reshard()
    return {"units": units}


def reduced_in_reduce_dtype(student, rank, given):
    fsdp, _ = _wrapped(student, given, given["precision"])
    start = rank.events_now()
    fsdp(*given["batches"][0]).backward()
    return {"dtypes": rank.comm_events(start)}  # what the grader's relay carried (checks.py reads the dtypes)


def add_grad_completes(student, rank, given):
    """A block's parameters' gradients handed to add_grad one by one: what it answered each time, its buffer's dtype."""
    fsdp, _ = _wrapped(student, given)
    unit = fsdp.units[1]
    unit.views.full()  # as in backward: the parameters are the full (param_dtype) tensors autograd gives gradients to
    said = []
    for p in unit.params:
        p.grad = torch.ones(p.shape, dtype=p.dtype)
        said.append(bool(unit.add_grad(p)))
    return {
        "complete": said,
        "buffer": str(unit.grads.data.dtype).removeprefix("torch.") if unit.grads is not None else "none",
    }


def fp32_for_the_optimizer(student, rank, given):
    fsdp, _ = _wrapped(student, given, given["precision"])
    for x, y in given["batches"]:  # two micro-batches, one step
        fsdp(x, y).backward()
    return {"grads": {u.name: u.mine.grad for u in fsdp.units}}


def close_to_fp32(student, rank, given):
    fsdp, opt = _wrapped(student, given)
    losses = []
    for x, y in given["batches"]:
        loss = fsdp(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.float().item())
    return {"losses": losses, "params": dict(fsdp.full_state_dict())}


def bytes_halved(student, rank, given):
    fsdp, opt = _wrapped(student, given)
    start = rank.events_now()
    fsdp(*given["batches"][0]).backward()
    opt.step()
    return {"comms": rank.comm_events(start)}
