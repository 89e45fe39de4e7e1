"""Where the stages begin: the model's repeated blocks, cut into pp x virtual_stages runs of blocks.

A model that pipelines is read as three parts (the toolkit GPT is one; any model that has them is too):

    embed(x) -> h            on the first stage (token and position embeddings)
    the repeated blocks      h -> h, spread over the stages, found as FSDP's default policy finds its units
                             (every toolkit Block, else the children of a ModuleList of one class)
    head_loss(h, y) -> loss  on the last stage (final norm, head, loss)
    hidden_shape(x.shape)    the shape of h, so a stage knows what it receives before it arrives

By default the blocks are shared out evenly, as Megatron-LM does (so the first stage also holds the
embedding and the last the head: for a small model those make the ends heavier, which `pp_split` can
balance). `pp_split` names the block where each stage after the first begins.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

PROTOCOL = ("embed", "head_loss", "hidden_shape")


@dataclass(frozen=True)
class Split:
    """The blocks' container (its qualified name), and the block indices of every stage in order."""

    container: str
    stages: tuple  # stages[s] = the keys (in the container) of stage s's blocks, in order

    def names(self, stage: int) -> list[str]:
        return [f"{self.container}.{key}" for key in self.stages[stage]]


def find_blocks(model: nn.Module) -> tuple[str, list[str]]:
    """(the container's name, its children's keys in order): the repeated blocks a pipeline spreads out."""
    from ..fsdp_policy import default_units

    missing = [name for name in PROTOCOL if not callable(getattr(model, name, None))]
    if missing:
        raise ValueError(
            f"pipeline parallelism runs a model in three parts on different ranks: embed(x) on the first "
            f"stage, its repeated blocks spread over the stages, head_loss(h, y) on the last (and "
            f"hidden_shape(x.shape), the shape between blocks). This {type(model).__name__} has no "
            f"{missing}: add them (toolkit.models.GPT shows how), or use tp= or a data-parallel "
            f"strategy alone."
        )
    units, _ = default_units(model)
    containers = {name.rpartition(".")[0] for name in units}
    if not units or len(containers) != 1:
        raise ValueError(
            f"pipeline parallelism spreads a model's repeated blocks (a ModuleList of one class) over "
            f"the stages; this {type(model).__name__} has "
            f"{'none' if not units else 'blocks in several lists: ' + str(sorted(containers))}."
        )
    container = containers.pop()
    keys = [name.rpartition(".")[2] for name in units]
    if keys != [k for k, _ in model.get_submodule(container).named_children()]:
        raise ValueError(f"pipeline parallelism: every child of {container!r} must be a block (found {keys}).")
    return container, keys


def split(model: nn.Module, stages: int, pp: int, pp_split=None) -> Split:
    """The blocks of each of `stages` stages (pp x virtual_stages), evenly or where `pp_split` says."""
    container, keys = find_blocks(model)
    n = len(keys)
    what = f"pp={pp}" if stages == pp else f"pp={pp} x virtual_stages={stages // pp} = {stages}"
    if pp_split is None:
        if n % stages:
            fits = [d for d in range(2, n + 1) if n % d == 0]
            per = -(-n // stages)
            starts = [f"{container}.{k}" for k in range(per, n, per)][: stages - 1]
            raise ValueError(
                f"the model's {n} blocks ({container}.0..{container}.{n - 1}) do not split evenly into "
                f"{what} stages. Use a number of stages that divides {n} ({fits or 'none: 1 block'}), "
                f"or say where stages begin, e.g. pp_split={starts} (uneven stages)."
            )
        per = n // stages
        return Split(container, tuple(tuple(keys[s * per : (s + 1) * per]) for s in range(stages)))
    names = list(pp_split) if isinstance(pp_split, (list, tuple)) else None
    if names is None or len(names) != stages - 1 or not all(isinstance(s, str) for s in names):
        raise ValueError(
            f"pp_split names the block where each stage after the first begins: {stages - 1} module "
            f"name(s) for {what} stages, e.g. {[f'{container}.{k * n // stages}' for k in range(1, stages)]}; "
            f"got {pp_split!r}."
        )
    modules = dict(model.named_modules())
    starts = []
    for name in names:
        if name not in modules:
            raise ValueError(
                f"pp_split names {name!r}, which is no module of this {type(model).__name__}; stages begin "
                f"at one of its blocks: {container}.0 .. {container}.{n - 1}."
            )
        parent, _, key = name.rpartition(".")
        if parent != container or key not in keys:
            raise ValueError(
                f"pp_split names {name!r}, which is not one of the repeated blocks; stages begin at a "
                f"block: {container}.0 .. {container}.{n - 1}."
            )
        starts.append(keys.index(key))
    bounds = [0] + starts + [n]
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(
            f"pp_split={names} must name blocks in increasing order, each stage keeping at least one "
            f"block (stages would hold {[b - a for a, b in zip(bounds, bounds[1:])]} blocks)."
        )
    return Split(container, tuple(tuple(keys[a:b]) for a, b in zip(bounds, bounds[1:])))
