"""What the world-4 launch of tests/test_tensor_parallel.py checks on every rank besides training: the fp16
vote, the mesh on the wrapped model, and clipping's count of the gradient's pieces. (The world-2 launch runs the
fp16 vote too.)"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

import toolkit
from toolkit.models import SyntheticCorpus

SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def overflow_on_one_rank(strategy="local"):
    """fp16 under tp: an inf in the last rank's piece of a gradient skips the step on every rank. At world 4
    (zero2 over dp 2 x tp 2) the inf lands, after the reduce-scatter over its dp group, in one rank's slice
    only: the ranks of the other dp group saw nothing, and skip because the vote is taken over the world.
    Every rank's (skipped, nothing moved, scale)."""
    torch.manual_seed(0)
    model, opt = toolkit.parallel.wrap(
        toolkit.models.tiny_gpt(), strategy, optimizer=SGD, tp=2, mixed_precision=torch.float16
    )
    world, rank = dist.get_world_size(), dist.get_rank()
    x, y = SyntheticCorpus().batch(0, 8, rank=rank // 2, world_size=world // 2)
    if rank == world - 1:  # only this rank's half of the first MLP's weight overflows
        weight = dict(model.module.named_parameters())["blocks.0.mlp.fc.weight"]
        weight.register_hook(
            lambda g: g.index_put((torch.tensor(0), torch.tensor(0)), torch.tensor(float("inf"), dtype=g.dtype))
        )
    before = toolkit.parallel.full_state_dict(model)
    model(x, y).backward()
    opt.step()
    after = toolkit.parallel.full_state_dict(model)
    mine = (model.scaler.last_skipped, all(torch.equal(before[k], after[k]) for k in before), model.scaler.scale)
    every = [None] * world
    dist.all_gather_object(every, mine)
    return every


def wrapped_mesh():
    """The layout on the wrapped model is torch's DeviceMesh, named as FSDP2/DTensor/torchtitan name it."""
    from torch.distributed.device_mesh import DeviceMesh

    model, _ = toolkit.parallel.wrap(toolkit.models.tiny_gpt(), "ddp", tp=2)
    return isinstance(model.mesh, DeviceMesh), model.mesh.mesh_dim_names, tuple(model.mesh.shape)


def norm_of_ones(strategy, options, build=None):
    """(the norm clip_grad_norm_ returns with every gradient element 1, Ψ of the whole model, every gradient
    element after clipping to a norm of 1: the same 1/sqrt(Ψ) everywhere). build: the model (the tiny GPT)."""
    torch.manual_seed(0)
    model, _ = toolkit.parallel.wrap(
        build() if build else toolkit.models.tiny_gpt(), strategy, optimizer=SGD, **options
    )
    psi = sum(v.numel() for v in toolkit.parallel.full_state_dict(model).values())  # every expert, tp pieces joined
    rank = dist.get_rank()
    model(*SyntheticCorpus().batch(0, 8, rank=rank // 2, world_size=2)).backward()
    engine = getattr(model, "engine", None)
    grads = (
        [piece.mine.grad for piece in engine.pieces]
        if hasattr(engine, "pieces")
        else [p.grad for p in model.module.parameters()]
    )
    for g in grads:
        if g is not None:
            g.fill_(1.0)
    norm = model.clip_grad_norm_(1e9).item()
    model.clip_grad_norm_(1.0)
    after = {round(v, 6) for g in grads if g is not None for v in g.unique().tolist()}
    return norm, psi, after
