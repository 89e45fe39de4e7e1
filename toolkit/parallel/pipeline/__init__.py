"""Pipeline parallelism: the model cut into stages, the batch into micro-batches, a schedule between them.

    model, opt = toolkit.parallel.wrap(tiny_gpt(n_layer=4), "ddp", pp=2, microbatches=4, schedule="1f1b")
    loss = model.forward_backward(x, y); opt.step(); opt.zero_grad()

Read in this order:

    schedules.py   every rank's actions as a list: GPipe, 1F1B, interleaved (virtual stages), ZB-H1
    lowering.py    the sends and receives each action implies; a dry run that finds deadlocks and bubbles
    split.py       where the stages begin (the model's repeated blocks, evenly or by pp_split)
    stage.py       one stage of the model, its forward; a weight tied across the first and last stage
    p2p.py         activations and gradients between stages, through toolkit.comm
    backward.py    backward split into input and weight gradients (zero-bubble schedules)
    driver.py      one step on one rank: the program, action by action
    model.py       the wrapped model (forward_backward) and the optimizers of a rank's stages
    bubble.py      the bubble and activation formulas, and both measured from a Run
    checkpoint.py  full checkpoints across layouts

`wrap` is step 3 of `toolkit.parallel.compose`: tensor parallelism has already split the layers, and the
data-parallel strategy wraps each stage over the dp group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...models import hf_pipeline
from ...moe.layer import MoE
from ...runtime import env
from .. import mesh as mesh_
from .. import rng
from . import lowering, schedules
from .driver import Driver
from .lowering import PipelineDeadlock
from .model import ChainedOptimizer, PipelineModel
from .schedules import SCHEDULES, Action
from .split import split as split_model
from .stage import cut, find_tie

__all__ = ["wrap", "Action", "SCHEDULES", "PipelineDeadlock", "PipelineModel", "stage_group"]


def wrap(
    model, mesh, build, optimizer, options: dict, *, microbatches=None, schedule="1f1b", virtual_stages=1, pp_split=None
):
    """(PipelineModel, ChainedOptimizer) of this rank's stages, each wrapped by `build` (the dp strategy)."""
    layout = mesh_.layout_of(mesh)
    pp, me, dp_rank = layout.pp, mesh_.coordinate(mesh).pp, mesh_.data_parallel_rank(mesh)
    rng.offset_stage(me, env.device())  # stages draw dropout masks of their own
    v = _positive("virtual_stages", virtual_stages)
    m = pp if microbatches is None else _positive("microbatches", microbatches)
    check_schedule(schedule, pp, m, v)
    dtype = _compute_dtype(options)
    stages_total = pp * v
    model = hf_pipeline.pipelined(model) if hf_pipeline.is_hf(model) else model  # as it came: its three parts
    split = split_model(model, stages_total, pp, pp_split)
    hf_pipeline.announce(model, split)
    tie = find_tie(model, split, dtype, env.device())
    actions = schedules.build(schedule, pp, m, v)
    programs = lowering.lower(actions, pp, tied=tie is not None)
    split_backward = schedules.splits_backward(actions)
    lowering.replay(programs, lowering.unit_cost(split_backward))  # a schedule that would deadlock stops here
    names = [n for n, _ in model.named_parameters()]  # the whole model's, as a one-process checkpoint has them
    mine = [me + k * pp for k in range(v)]
    wrapped, optimizers = {}, []
    for s in mine:
        part = cut(model, split, s, tie)
        _check_experts(part, mesh)
        wrapped[s], opt = build(part, optimizer, **options)
        optimizers.append(opt)
        if split_backward and getattr(getattr(wrapped[s], "engine", None), "name", None) == "fsdp":
            raise ValueError(
                f"schedule={schedule!r} splits each backward in two (B, then W later), but FSDP frees a "
                f"unit's gathered parameters at the end of every backward, so W would read freed "
                f"memory. Use schedule='1f1b' with fsdp, or zero-bubble with local, dp, ddp or zero1-3 "
                f"(ZeRO-3 keeps a module gathered until its gradients are complete)."
            )
    info_tp = getattr(model, "tensor_parallel", None)  # tp ranks holding the same activations send 1/t each
    scatter = info_tp.tp if info_tp is not None and not info_tp.sequence_parallel else None
    driver = Driver(
        wrapped,
        programs[me],
        lowering.send_order(programs),
        mesh_.group(mesh, "pp"),
        me,
        m,
        stages_total,
        split=split_backward,
        tie=tie,
        hidden_shape=part.hidden_shape,
        dtype=dtype,
        device=env.device(),
        scatter=scatter,
    )
    info = {
        "pp": pp,
        "microbatches": m,
        "schedule": schedule if isinstance(schedule, str) else schedule.__name__,
        "virtual_stages": v,
        "stages": mine,
        "split": split,
        "actions": actions,
        "programs": programs,
        "dp_rank": dp_rank,
        "rank": me,
        "tied": tie.name if tie is not None else None,
        "names": names,
    }
    return PipelineModel(wrapped, driver, info, getattr(model, "tensor_parallel", None)), ChainedOptimizer(optimizers)


def check_schedule(schedule, pp: int, microbatches: int, virtual_stages: int) -> None:
    """The errors a schedule's numbers can have, said before anything is built."""
    schedules.resolve(schedule, virtual_stages)
    if schedule in ("1f1b", "interleaved", "zb-h1") and microbatches < pp:
        bubble = (pp - 1) / (microbatches + pp - 1)
        raise ValueError(
            f"schedule={schedule!r} with microbatches={microbatches} < pp={pp}: a pipeline of {pp} stages "
            f"needs at least {pp} micro-batches in flight to keep every stage busy in its steady state; with "
            f"{microbatches}, the stages idle (the bubble, (pp-1)/(m+pp-1) = {bubble:.0%} of the step) and "
            f"1F1B never reaches its one-forward-one-backward rhythm. Use microbatches >= {pp} (more is "
            f"better: 4 x pp gives a bubble of {(pp - 1) / (5 * pp - 1):.0%})."
        )


def stage_group(*, pp: int, tp: int = 1, cp: int = 1, order: str = mesh_.ORDER):
    """The ranks of this rank's pipeline stage (its dp x cp x tp ranks): the group an MoE layer's experts are split
    over under pp (build the MoE GPT with `moe_gpt(group=stage_group(pp=2))` before wrapping it)."""
    layout = mesh_.layout(dist.get_world_size(), tp=tp, pp=pp, cp=cp, order=order)
    mine = None
    for stage in range(pp):  # every rank makes every group, in the same order (torch's rule)
        ranks = [r for r in range(layout.world_size) if layout.coordinate(r).pp == stage]
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def _check_experts(part, mesh) -> None:
    """An MoE layer's experts must be split over ranks of this stage only (the others run other layers)."""
    layout = mesh_.layout_of(mesh)
    me = mesh_.coordinate(mesh).pp
    for name, module in part.named_modules():
        if isinstance(module, MoE) and module.world > 1:  # (a layer of one rank holds every expert itself)
            from ... import comm

            ranks = comm.group_ranks(module.group)
            others = [r for r in ranks if layout.coordinate(r).pp != me]
            if others:
                raise ValueError(
                    f"pipeline parallelism: the MoE layer {name!r} splits its experts over ranks {ranks}, "
                    f"but ranks {others} hold other pipeline stages. Build the model with "
                    f"moe_gpt(group=toolkit.parallel.pipeline.stage_group(pp={layout.pp}, tp={layout.tp}, "
                    f"cp={layout.cp}, order={layout.order!r})) "
                    f"(TrainConfig's moe_model_fn does this for you)."
                )


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}.")
    return value


def _compute_dtype(options: dict) -> torch.dtype:
    """The dtype activations cross between stages in: the strategy's 16-bit compute type, else fp32."""
    from ..fsdp_unit import dtypes

    dtype = dtypes(options.get("mixed_precision", False))[0]
    if dtype == torch.float16:
        raise ValueError(
            "pipeline parallelism here runs fp32 or bfloat16 (mixed_precision=True): fp16 would need "
            "its loss scale applied at the last stage only and its overflow vote taken over every "
            "stage, which this toolkit does not do. Use mixed_precision=True (bfloat16)."
        )
    return dtype
