"""What every rank runs for lab 06's checks, next to your code: the toolkit's GPT (from the seed the grader
sent) under your Zero2, trained on this rank's rows, and what was observed (the gradient slice, the
optimizer's states, the parameters, the collectives recorded). The grader's process judges (checks.py)."""

import functools

import torch

from toolkit.models import tiny_gpt
from toolkit.parallel.flat import FlatBuffer


def _zero(student, rank, given):
    torch.manual_seed(given["seed"])
    model = tiny_gpt(**given["config"])
    optimizer = functools.partial(torch.optim.AdamW, **given["optimizer"])
    return student.Zero2(model, optimizer, group=rank.group), model


def _flat(model, world) -> torch.Tensor:
    tensors = [p.detach() for p in model.parameters()]
    flat = FlatBuffer([t.shape for t in tensors], world)
    flat.copy_from(tensors)
    return flat.data.clone()


def bounds(student, rank, given):
    return {"bounds": student.shard_bounds(given["numel"], given["world_size"], given["rank"])}


def gradient_slices(student, rank, given):
    z, model = _zero(student, rank, given)
    model(*given["batches"][0]).backward()
    return {"full_left": [n for n, p in model.named_parameters() if p.grad is not None], "grad": z.master.grad}


def states_are_sharded(student, rank, given):
    z, model = _zero(student, rank, given)
    model(*given["batches"][0]).backward()
    z.step()
    held = sum(
        t.numel() * t.element_size() for s in z.optimizer.state.values() for t in s.values() if torch.is_tensor(t)
    )
    return {"held": held, "gradient_kept": z.master.grad is not None}


def parity(student, rank, given):
    z, model = _zero(student, rank, given)
    before = _flat(model, rank.world_size)
    after_first = None
    for x, y in given["batches"]:
        model(x, y).backward()
        z.step()
        z.zero_grad()
        if after_first is None:
            after_first = _flat(model, rank.world_size)
    return {
        "before": before,
        "after_first": after_first,
        "params": {name: p.detach() for name, p in model.named_parameters()},
    }


def bytes_per_step(student, rank, given):
    z, model = _zero(student, rank, given)
    start = rank.events_now()
    model(*given["batches"][0]).backward()
    z.step()
    return {"comms": rank.comm_events(start)}
