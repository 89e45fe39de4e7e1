"""Expert parallelism on the one mesh: which ranks split an MoE layer's experts, and which hold copies of them.

The layout rule, Megatron-core's (its expert rank generator, with cp folded in):

1. The ranks that hold the same dense parameters are those of a pipeline stage: dp x cp x tp. Routing is per
   token, so every one of them routes its own tokens: a cp rank its part of each sequence, a dp rank its rows,
   and here a tp rank its share of the tokens its tp group holds (`tensor/moe.py`; Megatron's
   expert-tensor-parallel size 1).
2. Expert parallelism is carved out of them: listed innermost dimension first (tp, then cp, then dp, in the
   order's nesting), each run of `ep` consecutive ranks splits the experts (`mesh.Layout.expert_groups`);
   the ranks at the same place of every run hold copies of the same experts: an expert-data-parallel group of
   dp x cp x tp / ep ranks. ep = the whole stage (the default, `moe_gpt(group=None)`) leaves one copy of each.
3. Gradients: a dense parameter's are averaged over dp x cp (`mesh.group(mesh, "dp", "cp")`). An expert's
   arrive from every token of its ep group through the all-to-all's backward, summed; the copies' sums are
   added over the expert-data-parallel group (the data-parallel strategy's `expert_group`), and the total is
   divided by dp x cp as the dense ones are. So each expert's gradient is what one process computes on the
   whole batch, averaged the same way.

An MoE layer over any other set of ranks would hold experts some tokens never reach, or copies no one averages:
refused before any step, in the words of the layout's keywords (`check`).
"""

from __future__ import annotations

import torch.distributed as dist

from .. import comm
from . import mesh as mesh_

REDUCES_EXPERT_COPIES = ("dp", "ddp")  # the strategies that hold experts at all (zero1-3 and fsdp refuse them)


def expert_layers(model) -> list:
    """(name, layer) of every MoE layer whose experts are split over ranks (its expert parameters are tagged)."""
    from ..moe.experts import is_expert
    from ..moe.layer import MoE

    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoE) and any(map(is_expert, m.parameters()))]


def check(model, layout: mesh_.Layout, strategy: str, ep=None):
    """Refuse MoE layers whose experts are not split as the layout rule says; return this rank's
    expert-data-parallel group when the experts have copies (ep smaller than a stage), else None.
    (A layer over ranks of another pipeline stage is the pipeline's to refuse: `pipeline._check_experts`.)"""
    layers = expert_layers(model)
    if not layers:
        if ep is not None:
            raise ValueError(
                f"ep={ep!r} splits the experts of a model's MoE layers, but {type(model).__name__} has none "
                f"(toolkit.moe.MoE, or a Hugging Face MoE block made expert-parallel): leave ep out."
            )
        return None
    me = layout.coordinate(dist.get_rank())
    stage = [r for r in range(layout.world_size) if layout.coordinate(r).pp == me.pp]
    found = {}
    for name, layer in layers:
        ranks = comm.group_ranks(layer.group)
        if set(ranks) <= set(stage):  # (else: the pipeline's error)
            found[name or type(layer).__name__] = ranks
    if not found:
        return None
    if ep is not None:
        layout.expert_groups(ep)  # ep must divide the stage: said in its words
    size = ep if ep is not None else len(next(iter(found.values())))  # by default, what the model was built over
    carving = layout.expert_groups(size)[0] if len(stage) % size == 0 else []
    for name, ranks in found.items():
        if sorted(ranks) in carving:
            continue
        own = next((g for g in carving if dist.get_rank() in g), None)
        why = (
            f"this rank's expert-parallel group of {size} is {own}: Megatron-core's carving of the stage's "
            f"dp x cp x tp = {stage} ranks into runs of {size}, innermost dimension first ({carving}; "
            f"`toolkit.parallel.mesh.layout(...).expert_groups({size})`)"
            if own
            else f"{size} ranks do not divide the stage's dp x cp x tp = {stage} ranks into groups"
        )
        raise ValueError(
            f"with {_keywords(layout)}{f' and ep={ep}' if ep is not None else ''}, the MoE layer {name!r} "
            f"splits its experts over ranks {ranks}, but {why}. Any other group leaves ranks of the stage whose "
            f"tokens never reach these experts, or copies of them that are never averaged. Build the model with "
            f"group={_builder(layout, size if own else len(stage), len(stage))}, as TrainConfig's moe_model_fn "
            f"does (from its options ep=, tp=, pp=, cp=)."
        )
    if size == len(stage):
        return None
    if strategy == "local":
        raise ValueError(
            f"with {_keywords(layout)} and ep={size}, each expert has {len(stage) // size} copies (on the "
            f"expert-data-parallel ranks), whose gradients must be averaged, and strategy 'local' averages "
            f"nothing: name 'dp' or 'ddp', or ep={len(stage)} (one copy of each expert)."
        )
    if strategy not in REDUCES_EXPERT_COPIES:
        return None  # the strategy refuses expert parameters itself (consistency.reject_experts)
    return mesh_.own_group(layout.expert_groups(size)[1])


def _keywords(layout: mesh_.Layout) -> str:
    named = [f"{d}={layout.size(d)}" for d in ("tp", "pp", "cp") if layout.size(d) > 1]
    return f"{', '.join(named) or 'no tp, pp or cp'} ({layout})"


def _builder(layout: mesh_.Layout, size: int, stage: int) -> str:
    if size == stage:
        if layout.pp == 1:
            return "None (the whole world)"
        return f"toolkit.parallel.pipeline.stage_group(pp={layout.pp}, tp={layout.tp}, cp={layout.cp}, ...)"
    keywords = ", ".join(f"{d}={layout.size(d)}" for d in ("tp", "pp", "cp") if layout.size(d) > 1)
    return f"toolkit.parallel.mesh.expert_group({size}{', ' + keywords if keywords else ''})"
