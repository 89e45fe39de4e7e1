"""What the labs that train the toolkit's tiny GPT share on the grader's side: their inputs, their reference, and
the model's layout as the grader knows it.

A rank receives the model's seed (drawn for the grading) and only its own rows of each step's global batch;
the judge trains the same model in one process on the whole batch, the reference a correct strategy matches.
What the model is made of (its parameters, FSDP's units and their padded sizes) the grader works out here, from
the model's definition: a judge never takes a rank's word for the shapes it judges against.

    inputs=training(steps=3, global_batch=12, optimizer=dict(lr=0.1, momentum=0.9))
    reference = local(seed, steps=3, global_batch=12, optimizer=torch.optim.SGD, options=dict(lr=0.1, ...))
    returns=lambda case, r, n: {"params": Keys(parameters(), ...)}
"""

from __future__ import annotations

import functools

import torch

from ..models import SyntheticCorpus, tiny_gpt
from ..parallel.flat import padded_numel
from ..parallel.fsdp_policy import plan


def training(steps: int, global_batch: int, optimizer: dict, **extra):
    """Inputs for `@check(inputs=...)`: the seed, this rank's rows of `steps` global batches, the optimizer's
    options (and `extra`, the same on every rank)."""

    def make(n, g):
        seed = int(torch.randint(0, 2**31, (), generator=g))
        corpus = SyntheticCorpus()
        return [
            dict(
                seed=seed,
                optimizer=optimizer,
                **extra,
                batches=[corpus.batch(s, global_batch, rank=r, world_size=n) for s in range(steps)],
            )
            for r in range(n)
        ]

    return make


def local(seed: int, steps: int, global_batch: int, optimizer, options: dict, model_options: dict = None, rows=None):
    """The reference: the model of `seed` trained alone on the whole batch (or on `rows`) for `steps` steps of
    `optimizer(**options)`; with steps=0, after one backward (the gradients are then in `.grad`)."""
    torch.manual_seed(seed)
    model = tiny_gpt(**(model_options or {}))
    opt = optimizer(model.parameters(), **options)
    for step in range(max(steps, 1)):
        model(*(rows or SyntheticCorpus().batch(step, global_batch, rank=0, world_size=1))).backward()
        if steps:
            opt.step()
            opt.zero_grad()
    return model


@functools.cache
def _meta_gpt(config: tuple):
    with torch.device("meta"):
        return tiny_gpt(**dict(config))


def parameters(config: dict | None = None) -> dict:
    """{name: a meta tensor of its shape and dtype} of the tiny GPT (with `config`), in registration order (a tied
    parameter once, as `model.parameters()` gives it)."""
    return dict(_meta_gpt(tuple(sorted((config or {}).items()))).named_parameters())


def fsdp_units(shard_size: int, config: dict | None = None) -> list[dict]:
    """FSDP's units of the tiny GPT (the default wrap policy), as `toolkit.parallel.fsdp` builds them, sharded over
    `shard_size` ranks: [{"name", "param_names", "shapes", "numel", "padded", "shard"}], root first."""
    model = _meta_gpt(tuple(sorted((config or {}).items())))
    names = {id(p): name for name, p in model.named_parameters()}
    units = []
    for unit in plan(model):
        numel = sum(p.numel() for p in unit.params)
        units.append(
            {
                "name": unit.name or "(root)",
                "param_names": [names[id(p)] for p in unit.params],
                "shapes": [tuple(p.shape) for p in unit.params],
                "numel": numel,
                "padded": padded_numel(numel, shard_size),
                "shard": padded_numel(numel, shard_size) // shard_size,
            }
        )
    return units
