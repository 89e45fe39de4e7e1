"""A simulation, priced: the cluster a user names resolved, and a Simulation's steps costed on it.

`simulate(..., cluster=...)` prices through `pricer` (the rank's programs with `cost.estimate`, a pipeline's
stages together with `pipelined.estimate_pipeline`, the peak against the accelerator's memory with `fit`);
`price(sim, cluster)` prices a Simulation again on another cluster. "this-machine" is measured, not listed: it
is calibrated here, on demand (`calibrate.this_machine`), so that pricing on a GPU preset loads no measuring code.
"""

from __future__ import annotations

import torch

from .cost import StepCost, estimate
from .fit import check_fit
from .hardware import THIS_MACHINE, Cluster, check_mfu, cluster_of
from .pipelined import estimate_pipeline, useful_flops


def resolve(cluster, world_size: int) -> Cluster:
    """A Cluster from what a user passes; "this-machine" is calibrated for `world_size` ranks (cached)."""
    if isinstance(cluster, str) and cluster.lower() == THIS_MACHINE:
        from .calibrate import this_machine  # measuring code, loaded only when asked for

        return this_machine(world_size)
    return cluster if isinstance(cluster, Cluster) else cluster_of(cluster)


def dtype_of(options: dict) -> str:
    """The dtype a strategy computes in: its mixed-precision option's 16-bit type, else fp32."""
    from ..parallel.fsdp_unit import dtypes

    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtypes(options.get("mixed_precision", False))[0], "fp32")


def _priced(sim, found: Cluster, mfu, dtype, stage_sims: dict | None = None) -> StepCost:
    """The simulation's programs on `found`, whose nodes are taken to be the simulation's; under pp > 1 with every
    stage of its pipeline (`stage_sims`), all of them together."""
    if found.gpus_per_node != sim.ranks_per_node:
        found = found.with_changes(gpus_per_node=sim.ranks_per_node)
    common = dict(world_size=sim.world_size, mfu=mfu, dtype=dtype or dtype_of(sim.options), config=sim.run.config)
    if stage_sims is None:
        cost = estimate(sim.programs, found, rank=sim.rank, **common)
        cost.useful_flops, cost.fit = sim.useful_flops_per_step(), check_fit(sim, found)
        return cost
    cost = estimate_pipeline(stage_sims, found, rank=sim.rank, **common)
    fits = {r: check_fit(s, found) for r, s in stage_sims.items()}
    cost.useful_flops = useful_flops(stage_sims)
    cost.fit = fits[sim.rank] if all(f.fits for f in fits.values()) else next(f for f in fits.values() if not f.fits)
    return cost


def pricer(cluster, world_size: int, *, mfu: float | None = None, dtype: str | None = None):
    """Check `cluster` and `mfu` now; return price(sim, stage_sims=None), which fills sim.cost, sim.fit,
    sim.modelled_run and, when the peak fits in the accelerator's memory, sim.step_time, sim.tflops_per_gpu,
    sim.mfu, sim.hfu, sim.breakdown (None when it does not: it would not run). What `simulate(..., cluster=...)`
    does; under pp > 1 it passes every stage of the pipeline, and every stage must fit."""
    found = resolve(cluster, world_size)
    if mfu is not None:
        check_mfu(mfu)

    def price(sim, stage_sims: dict | None = None) -> StepCost:
        cost = _priced(sim, found, mfu, dtype, stage_sims)
        sim.cost, sim.modelled_run, sim.fit = cost, cost.run, cost.fit
        ran = cost.fit.fits
        sim.step_time, sim.tflops_per_gpu, sim.mfu, sim.hfu, sim.breakdown = (
            (cost.step_time, cost.tflops_per_gpu, cost.mfu, cost.hfu, cost.breakdown) if ran else (None,) * 5
        )
        return cost

    return price


def price(sim, cluster="dgx-a100", *, mfu: float | None = None, dtype: str | None = None) -> StepCost:
    """What a Simulation's steps would cost on another cluster (or at another mfu): a StepCost; `sim` is unchanged
    (a pipelined one is priced with the stages it was simulated with)."""
    return _priced(
        sim,
        resolve(cluster, sim.world_size),
        None if mfu is None else check_mfu(mfu),
        dtype,
        getattr(sim, "stage_sims", None),
    )
