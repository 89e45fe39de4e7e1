"""What every rank runs for lab 03's checks, next to your code: the toolkit's tiny GPT (from the seed the
grader sent) wrapped in FSDP with your MyUnit, driven through unshard, reshard, forward and backward on this
rank's rows, and what was observed on the way (states, bytes held, the collectives recorded, parameter values,
gradient slices), unit by unit under the unit's name. The grader's process judges it (checks.py)."""

import functools

import torch

from toolkit.comm import collectives
from toolkit.models import tiny_gpt


def _wrapped(student, given, **options):
    torch.manual_seed(given["seed"])
    optimizer = functools.partial(torch.optim.SGD, **given["optimizer"])
    return student.wrap(tiny_gpt(), optimizer=optimizer, **options)


def _held(unit) -> int:
    """Bytes the unit's gathered flat parameter holds right now (0 when freed)."""
    return unit.flat.data.untyped_storage().nbytes()


def _values(unit) -> dict:
    """The gathered flat parameter's values, tensor by tensor (the module's parameters point at them only once FSDP
    has gathered the unit for its module; this task calls `unshard` directly)."""
    return {name: view.detach().clone() for name, view in zip(unit.param_names, unit.flat.views())}


def _gathers(rank, start) -> list:
    """Each all-gather `toolkit.comm` recorded on this rank since `start`: was it asynchronous? (the rank's own
    word: what the grader's relay carried is under "carried")"""
    return [bool(e["args"].get("async_op")) for e in rank.local_events(start) if e["name"] == "all_gather"]


def unshard_gathers(student, rank, given):
    fsdp, _ = _wrapped(student, given)
    units = {}
    for unit in fsdp.units:
        start, carried = rank.local_now(), rank.events_now()
        unit.unshard()
        units[unit.name] = {
            "state": unit.state,
            "held": _held(unit),
            "gathers": _gathers(rank, start),
            "carried": rank.comm_events(carried),
            "values": _values(unit),
        }
        unit.reshard()
    unit = fsdp.units[-1]  # asynchronous: in flight until wait_unshard
    start, carried = rank.local_now(), rank.events_now()
    unit.unshard(async_op=True)
    later = {"gathers": _gathers(rank, start), "carried": rank.comm_events(carried), "state_before_wait": unit.state}
    unit.wait_unshard()
    later.update(state=unit.state, values=_values(unit))
    unit.reshard()
    return {"units": units, "async": later}


def _waits_during(fn) -> int:
    """How many handles `fn()` waited for (the door's Handle.wait, counted)."""
    real, count = collectives.Handle.wait, [0]

    def counted(handle):
        count[0] += 1
        return real(handle)

    collectives.Handle.wait = counted
    try:
        fn()
    finally:
        collectives.Handle.wait = real
    return count[0]


def memory_is_freed(student, rank, given):
    fsdp, _ = _wrapped(student, given, forward_prefetch=True)
    after_reshard = {}
    for unit in fsdp.units:
        unit.unshard()
        unit.reshard()
        after_reshard[unit.name] = {"held": _held(unit), "state": unit.state}
    unit = fsdp.units[0]  # an all-gather in flight when reshard comes
    unit.unshard(async_op=True)
    in_flight = {"waits": _waits_during(unit.reshard), "held": _held(unit), "state": unit.state}
    seen = {}

    def note(unit, module, args):  # registered after FSDP's hooks: runs once the unit is gathered
        seen.setdefault(unit.name, (unit.state, _held(unit)))

    for unit in fsdp.units:
        unit.module.register_forward_pre_hook(functools.partial(note, unit))
    x, y = given["batches"][0]
    loss = fsdp(x, y)
    after_forward = {u.name: _held(u) for u in fsdp.units}
    loss.backward()
    return {
        "after_reshard": after_reshard,
        "in_flight": in_flight,
        "after_forward": after_forward,
        "while_running": {u.name: list(seen.get(u.name, (None, 0))) for u in fsdp.units},
        "after_backward": {u.name: _held(u) for u in fsdp.units},
    }


def one_step(student, rank, given):
    """One training step: the collectives it issued."""
    fsdp, opt = _wrapped(student, given)
    x, y = given["batches"][0]
    start = rank.events_now()
    fsdp(x, y).backward()
    opt.step()
    opt.zero_grad()
    return {"comms": rank.comm_events(start)}


def averaged_gradient_slices(student, rank, given):
    fsdp, _ = _wrapped(student, given)
    x, y = given["batches"][0]
    fsdp(x, y).backward()
    return {"grads": {u.name: u.mine.grad for u in fsdp.units}}


def parity_with_local(student, rank, given):
    fsdp, opt = _wrapped(student, given, forward_prefetch=True, backward_prefetch=True)
    for x, y in given["batches"]:
        fsdp(x, y).backward()
        opt.step()
        opt.zero_grad()
    return {"params": {name: p.detach().float() for name, p in fsdp.full_state_dict().items()}}
