"""Tensor parallelism (Megatron-LM; sequence parallelism from Korthikanti et al. 2022).

    model, opt = toolkit.parallel.wrap(tiny_gpt(), "fsdp", tp=2, sequence_parallel=True)  # world 4: dp 2

A tensor-parallel group of t ranks computes one model replica together: each rank holds a 1/t piece of
the large weights and computes with it, and the pieces meet in a collective twice per block and pass.
Read in this order:

    operators.py      Megatron's f and g (and sequence parallelism's halves): the only talk
    shards.py         which piece of a weight a rank keeps; joining pieces back
    linear.py         column-parallel and row-parallel linear layers (the MLP: column, then row)
    attention.py      attention split by heads
    embedding.py      the vocabulary split: embedding table and head
    cross_entropy.py  the loss on logits split by vocabulary
    sequence.py       sequence parallelism: layer norms on s/t positions, gradients summed
    overlap.py        tp_comm_overlap: sequence parallelism's collectives as rings hidden behind the GEMMs;
                      "backward": the column layers' backward collectives beside the weights' gradients
    ../rng.py         random numbers: dropout alike on replicated activations, its own on each rank's piece
    moe.py            Mixture-of-Experts under tensor parallelism (tokens shared out, experts over the world)
    gpt.py            the toolkit GPT's default plan;  plan.py: a `tp_plan` for any model
    state.py, clip.py full state and checkpoints across layouts; clipping by the global norm

`parallelize` is step 2 of `compose.py`: it changes the model in place and the data-parallel strategy
then wraps what this rank holds, over the dp group.
"""

from __future__ import annotations

import torch.nn as nn

from ...models.gpt import GPT
from ...runtime import env
from .. import mesh as mesh_
from .. import rng
from .linear import BACKWARD, ColumnParallelLinear, ParallelLinear
from .operators import TPGroup
from .shards import split_of
from .state import TensorParallel


def parallelize(
    model: nn.Module, mesh, *, plan=None, sequence_parallel: bool = False, comm_overlap: bool | str = False
) -> nn.Module:
    """Split `model` over the mesh's "tp" group, in place, and return it (with `model.tensor_parallel`).

    plan None: the toolkit GPT's default plan (`gpt.py`), or a Hugging Face model's own (`hf.py`); any other
    model needs `plan`, a tp_plan dict (`plan.py`). sequence_parallel comes with the GPT's plan; comm_overlap
    (`tp_comm_overlap`) runs its all-gathers and reduce-scatters as rings hidden behind the GEMMs, or ("backward") the
    column layers' backward collectives beside the weights' gradients only (`overlap.py`)."""
    tp = TPGroup.of(mesh_.group(mesh, "tp"))
    rng.seed_tensor_parallel(tp.rank, mesh.get_local_rank("pp"), env.device())  # split regions' dropout stream
    if plan is None and not isinstance(model, GPT):
        from .hf import own_plan

        plan = own_plan(model)
    if plan is None:
        if not isinstance(model, GPT):
            raise ValueError(
                f"tensor parallelism has a default plan for the toolkit's GPT only; for a "
                f"{type(model).__name__} pass tp_plan={{module name pattern: 'colwise' | 'rowwise' | "
                f"'vocab' | 'replicate'}}, e.g. an MLP's first Linear 'colwise' and its second 'rowwise'."
            )
        from .gpt import default_plan, parallelize_gpt

        described = default_plan(model)
        parallelize_gpt(model, tp, sequence_parallel)
    else:
        if sequence_parallel:
            raise ValueError(
                "sequence_parallel=True comes with the toolkit GPT's default plan, which knows where a "
                "block's sequence-local regions (layer norms, residuals) are; with a tp_plan, leave "
                "sequence_parallel off."
            )
        from .plan import apply_plan

        described = dict(plan)
        apply_plan(model, plan, tp)
    for layer in model.modules():
        if comm_overlap is True and isinstance(layer, ParallelLinear) and layer.sequence_parallel:
            layer.comm_overlap = True
        elif comm_overlap == BACKWARD and isinstance(layer, ColumnParallelLinear):
            layer.comm_overlap = BACKWARD
    info = TensorParallel(tp, {name: split_of(p) for name, p in model.named_parameters()}, sequence_parallel, described)
    model.tensor_parallel = info
    return model


__all__ = ["parallelize", "TensorParallel", "TPGroup"]
