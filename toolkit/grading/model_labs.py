"""What the labs that train the toolkit's tiny GPT share on the grader's side: their inputs and their reference.

A rank receives the model's seed (drawn for the grading) and only its own rows of each step's global batch;
the judge trains the same model in one process on the whole batch, the reference a correct strategy matches.

    inputs=training(steps=3, global_batch=12, optimizer=dict(lr=0.1, momentum=0.9))
    reference = local(seed, steps=3, global_batch=12, optimizer=torch.optim.SGD, options=dict(lr=0.1, ...))
"""
from __future__ import annotations

import torch

from ..models import SyntheticCorpus, tiny_gpt


def training(steps: int, global_batch: int, optimizer: dict, **extra):
    """Inputs for `@check(inputs=...)`: the seed, this rank's rows of `steps` global batches, the optimizer's
    options (and `extra`, the same on every rank)."""
    def make(n, g):
        seed = int(torch.randint(0, 2**31, (), generator=g))
        corpus = SyntheticCorpus()
        return [dict(seed=seed, optimizer=optimizer, **extra,
                     batches=[corpus.batch(s, global_batch, rank=r, world_size=n) for s in range(steps)])
                for r in range(n)]
    return make


def local(seed: int, steps: int, global_batch: int, optimizer, options: dict, model_options: dict = None,
          rows=None):
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
