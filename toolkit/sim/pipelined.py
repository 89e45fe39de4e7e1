"""A pipelined step's time: every stage of one pipeline simulated, their programs replayed together.

Under pp > 1 no rank's step is its own: stage s waits for stage s-1's activations and s+1's gradients,
and the step is the critical path across the stages. So `simulate(..., pp=P, cluster=...)` simulates, besides
the rank asked for, the other P - 1 ranks of its pipeline (the same dp and tp index, each pipeline rank:
`pipeline_of`), each running the pipeline's own schedule on the fake process group, and prices their
programs together (`toolkit.sim.stage_timeline`: a send feeds the receive that takes it, in order; a
transfer runs on the link between the two ranks' nodes; each stage's tensor- and data-parallel collectives
on its own links). Nothing here knows the schedule: the programs carry it, in the order each rank issued
its work. The rank asked for keeps its own memory, bytes and FLOPs; its step time, rate and breakdown
(compute, bubble, point-to-point, exposed collectives) are the pipeline's.

    sim = simulate(gpt, "ddp", 64, tp=8, pp=4, microbatches=16, cluster="dgx-a100")
    sim.step_time, sim.breakdown["bubble"], sim.cost.stages[-1].bubble(sim.rank), sim.stage_peaks

At scale the pipeline's programs are put together from one rank of each kind of stage
(`toolkit.sim.stage_assembly`).
"""

from __future__ import annotations

from ..parallel import mesh as mesh_
from .collective_time import collective_time
from .cost import StepCost, compute_time, model_flops, slowdown
from .hardware import Cluster, check_mfu, cluster_of
from .modelled_run import modelled_run
from .program import check, total_flops
from .stage_timeline import StagesTimeline, pair_transfers, schedule_stages
from .timeline import Timeline


def pipeline_of(world_size: int, rank: int, options: dict) -> list[int]:
    """The global ranks of `rank`'s pipeline, in stage order: same dp, cp and tp index, every pp index."""
    layout = mesh_.layout(
        world_size,
        tp=options.get("tp", 1),
        pp=options.get("pp", 1),
        cp=options.get("cp", 1),
        order=options.get("order", mesh_.ORDER),
    )
    return layout.group_of(rank, "pp")


def is_pipelined(options: dict) -> bool:
    return options.get("pp", 1) > 1


def stage_timelines(
    stage_sims: dict, seconds, cost, *, overlap: float = 1.0, beside: float = 1.0, slowdown: float = 0.0
):
    """Each step of the pipeline, its stages' programs replayed together, steps back to back: [StagesTimeline].
    stage_sims: {global rank: its Simulation}; seconds(rank, Compute); cost(rank, Collective) (`schedule_stages`)."""
    steps = {len(s.programs) for s in stage_sims.values()}
    if len(steps) != 1:
        raise ValueError(f"the pipeline's ranks simulated different numbers of steps: {sorted(steps)}")
    out, clock = [], 0.0
    for k in range(steps.pop()):
        programs = {r: s.programs[k] for r, s in stage_sims.items()}
        timeline = schedule_stages(
            programs,
            pair_transfers(programs),
            seconds,
            cost,
            start=clock,
            overlap=overlap,
            beside=beside,
            slowdown=slowdown,
        )
        out.append(timeline)
        clock = timeline.end
    return out


def as_rank_timeline(stages, rank) -> Timeline:
    """`rank`'s spans, on a timeline that ends when the pipeline's step ends (its idle tail is the bubble)."""
    mine = stages.stages[rank]
    return Timeline(mine.spans, stages.start, stages.end)


def useful_flops(stage_sims: dict) -> list[float]:
    """Per step, the average rank's FLOPs: the pipeline's stages differ (the embedding on the first, the head and
    loss on the last), and every pipeline of the world is the same, so the average is over one pipeline."""
    per_rank = [s.useful_flops_per_step() for s in stage_sims.values()]
    return [sum(step) / len(per_rank) for step in zip(*per_rank)]


def estimate_pipeline(
    stage_sims: dict,
    cluster,
    *,
    rank: int,
    world_size: int,
    mfu: float | None = None,
    dtype: str = "bf16",
    config: dict | None = None,
) -> StepCost:
    """One pipeline's steps priced together (`toolkit.sim.pipelined`): stage_sims {global rank: its Simulation},
    one per stage; the StepCost is `rank`'s, whose step is the pipeline's critical path."""
    found = cluster if isinstance(cluster, Cluster) else cluster_of(cluster)
    found.check_world(world_size)
    override = None if mfu is None else check_mfu(mfu)
    for sim in stage_sims.values():
        for program in sim.programs:
            check(program)
    cost = StepCost(found, dtype, override, rank=rank)
    cost.reprice = lambda other: estimate_pipeline(
        stage_sims, other, rank=rank, world_size=world_size, mfu=mfu, dtype=dtype, config=config
    )
    cost.stages = stage_timelines(
        stage_sims,
        lambda r, c: compute_time(c, found.gpu, dtype, override, cost.cache),
        lambda r, c: collective_time(found, c.op, c.size_bytes, c.group, r, c.args),
        overlap=found.overlap,
        beside=found.beside_compute,
        slowdown=slowdown(found),
    )
    stages = cost.stages
    for k, timeline in enumerate(stages):
        program = stage_sims[rank].programs[k]
        cost.timelines.append(as_rank_timeline(timeline, rank))
        cost.flops.append(total_flops(program))
        cost.model_flops.append(model_flops(program))
    cost.run = modelled_run(
        cost.timelines,
        found,
        rank=rank,
        world_size=world_size,
        config=dict(config or {}, cluster=found.name, dtype=dtype, mfu=override),
    )
    return cost


def estimate_stages(
    programs: dict, dependencies=None, cluster="dgx-a100", *, ranks: dict, world_size: int, dtype: str = "bf16"
) -> StagesTimeline:
    """One step of a pipeline priced on `cluster`: programs {stage: that stage's rank's program}, ranks {stage:
    its global rank} (which link a transfer or a collective takes), dependencies: `P2P` pairs (None: each send
    matched with its receive in order, `pair_transfers`). The step time is the critical path across the stages
    (`toolkit.sim.stage_timeline`); each stage's compute is priced operation by operation as on one rank."""
    found = cluster if isinstance(cluster, Cluster) else cluster_of(cluster)
    found.check_world(world_size)
    cache: dict = {}
    for program in programs.values():
        check(program)
    if dependencies is None:
        dependencies = pair_transfers(programs, ranks)
    return schedule_stages(
        programs,
        dependencies,
        lambda stage, c: compute_time(c, found.gpu, dtype, None, cache),
        lambda stage, c: collective_time(found, c.op, c.size_bytes, c.group, ranks[stage], c.args),
        overlap=found.overlap,
        beside=found.beside_compute,
        slowdown=slowdown(found),
    )
