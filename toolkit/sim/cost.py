"""What a simulated step costs: its programs, priced on a cluster, as time, TFLOP/s and a modelled Run.

    cost = estimate(sim.programs, "dgx-a100", world_size=512, dtype="bf16")
    cost.step_time, cost.breakdown, cost.tflops_per_gpu, cost.mfu, cost.hfu, cost.per_op(), cost.run

- Compute: every operation the step recorded, priced on its own (`kernel_time`: a GEMM's tiles in waves
  on the SMs at the rate a published cuBLAS measurement gives them, a fused attention at FlashAttention-2's
  published rate, anything else its bytes at the HBM bandwidth a streaming kernel reaches; the host's launches
  behind them). A segment with no operations recorded (a hand-written program) is one roofline: its FLOPs at the
  datasheet peak, or its bytes if slower. `mfu=` instead charges every FLOP at that fraction of peak (a what-if,
  not a prediction).
- Where the time goes (`breakdown`: GEMM, attention, memory-bound, optimizer, launch overhead, compute slowed
  beside collectives, exposed communication, bubble, point-to-point; they add up to the step) and how far the
  published sources' spread moves it (`band`: the step priced with every measurement at its worst and best end).
- MFU and HFU, as the papers report them: hfu = the FLOPs the step executed (recomputation included)
  over step time x peak; mfu = the model's FLOPs, 3 x its forward pass (PaLM's definition: backward
  is twice the forward; a recomputed forward is not counted), over the same.
- Communication: `collective_time` on the cluster's links; overlap: `timeline.schedule`.
- The Run (`modelled_run.py`) has the spans a real run's trace has, so the trace tools read it as one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..run import Run
from ..units import flops_text, percent_text, seconds_text
from . import breakdown as parts
from . import held_to_runs
from .collective_time import collective_time
from .hardware import Cluster, check_mfu, cluster_of
from .kernel_time import device_seconds, hbm_bandwidth, segment_seconds
from .modelled_run import modelled_run
from .program import Compute, check, total_flops
from .published import at
from .timeline import schedule


def compute_time(
    segment: Compute, gpu, dtype: str = "bf16", mfu: float | None = None, cache: dict | None = None
) -> float:
    """Seconds for one compute segment: its operations priced one by one (`kernel_time`); a segment without
    recorded operations, or any segment when `mfu` is given, as one roofline: max(FLOPs at mfu x peak (1 x
    peak by default), bytes at memory bandwidth) + ops x the host's overhead per operation."""
    if mfu is None and gpu.asynchronous and segment.views_only:
        return 0.0  # the host, running ahead of the device, dispatched them while it worked (kernel_time rule 4)
    if segment.kernels and mfu is None:
        return segment_seconds(segment, gpu, cache)[0]
    rate = gpu.flops_per_s(dtype) * (1.0 if mfu is None else mfu)
    memory = segment.bytes / hbm_bandwidth(gpu) if segment.bytes else 0.0
    return max(segment.flops / rate, memory) + segment.ops * gpu.op_overhead


def model_flops(program) -> float:
    """The model's FLOPs in a step: 3 x its forward pass's (PaLM's MFU; recomputation is not the model's)."""
    return 3.0 * sum(i.flops for i in program if isinstance(i, Compute) and i.phase == "forward")


@dataclass
class StepCost:
    """The modelled cost of a simulated rank's steps (the last one is the steady state reported)."""

    cluster: Cluster
    dtype: str
    mfu_override: float | None  # None: every operation priced on its own; else the flat fraction of peak
    timelines: list = field(default_factory=list)
    flops: list = field(default_factory=list)  # per step, this rank's, executed (recomputation included)
    run: Run | None = None
    model_flops: list = field(default_factory=list)  # per step, this rank's: 3 x the forward pass's FLOPs
    useful_flops: list | None = None  # per step, the average rank's: all ranks' work / world (None: = flops)
    fit: object = None  # the peak against the accelerator's memory (`fit.Fit`), when known
    rank: int = 0
    stages: list | None = None  # pp > 1: per step, the pipeline's stages replayed together (`pipelined`)
    reprice: object = field(default=None, repr=False)  # fn(Cluster) -> StepCost: the same steps on another cluster
    cache: dict = field(default_factory=dict, repr=False)  # Kernel -> device seconds on this cluster's GPU
    _band: dict | None = field(default=None, repr=False)

    @property
    def step_time(self) -> float:
        return self.timelines[-1].step_time

    @property
    def step_times(self) -> list[float]:
        return [t.step_time for t in self.timelines]

    @property
    def breakdown(self) -> dict:
        """Seconds of the last step by part (`toolkit.sim.breakdown`): gemm, attention, memory_bound, optimizer,
        overhead, contention (together "compute"), exposed_comm, and under pp > 1 bubble and p2p (another stage's
        compute, a transfer on the wire: `StagesTimeline.breakdown`); they add up to "step". overlapped_comm:
        collectives hidden behind compute, said beside."""
        mine = self.timelines[-1].breakdown()
        waits = mine if self.stages is None else self.stages[-1].breakdown(self.rank)
        return parts.step_breakdown(
            self.timelines[-1].spans,
            waits,
            mine["overlapped_comm"],
            self.cluster.gpu,
            self.mfu_override is not None,
            self.cache,
        )

    @property
    def band(self) -> dict:
        """The last step's seconds with every published measurement at the worst and at the best end of its
        sources' spread (`toolkit.sim.published`): {"worst": s, "best": s}; both the step itself where the
        cluster has no measurements (a user-defined or calibrated one)."""
        if self._band is None:
            measured = self.cluster.published is not None or self.cluster.gpu.published is not None
            self._band = {
                end: (self.reprice(at(self.cluster, end)).step_time if measured and self.reprice else self.step_time)
                for end in ("worst", "best")
            }
        return self._band

    @property
    def tflops_per_gpu(self) -> float:
        """The cluster's useful rate per GPU: all ranks' work / world size / step time (TFLOP/s)."""
        work = self.flops[-1] if self.useful_flops is None else self.useful_flops[-1]
        return work / self.step_time / 1e12 if self.step_time > 0 else 0.0

    @property
    def rank_tflops(self) -> float:
        """This rank's own FLOPs over the step time (differs from tflops_per_gpu where ranks' work differs)."""
        return self.flops[-1] / self.step_time / 1e12 if self.step_time > 0 else 0.0

    @property
    def share(self) -> float:
        """The average rank's work over this rank's: 1 where every rank does the same (MoE load may not)."""
        if self.useful_flops is None or not self.flops[-1]:
            return 1.0
        return self.useful_flops[-1] / self.flops[-1]

    def _utilisation(self, flops: float) -> float:
        """The cluster's: the average rank's `flops` over (step time x the accelerator's peak)."""
        peak = self.cluster.gpu.flops_per_s(self.dtype)
        return flops * self.share / self.step_time / peak if self.step_time > 0 else 0.0

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: 3 x the forward pass's FLOPs over (step time x peak), as the papers count it."""
        return self._utilisation(self.model_flops[-1])

    @property
    def hfu(self) -> float:
        """Hardware FLOPs utilisation: every FLOP run, recomputation too, over (step time x peak)."""
        return self._utilisation(self.flops[-1])

    def utilisation_text(self) -> str:
        """MFU multiplied out, so that no number beside it seems to contradict it: the rate compute ran at (of the
        peak) x the share of the step spent computing x model FLOPs over FLOPs run (recomputation) x the average
        rank's work over this rank's; then HFU, the same without the recomputation factor."""
        compute, peak = self.breakdown["compute"], self.cluster.gpu.flops_per_s(self.dtype)
        rate = self.flops[-1] / compute / peak if compute > 0 else 0.0
        computing = compute / self.step_time if self.step_time > 0 else 0.0
        useful = self.model_flops[-1] / self.flops[-1] if self.flops[-1] else 1.0
        p = percent_text
        text = (
            f"MFU {p(self.mfu)} = {p(rate)} of the {self.dtype} peak (the rate compute ran at) x "
            f"{p(computing)} of the step computing"
        )
        if abs(useful - 1) > 1e-3:
            text += f" x {useful:.2f} (model FLOPs, 3 x the forward's, over the FLOPs run)"
        if abs(self.share - 1) > 1e-3:
            text += f" x {self.share:.2f} (the average rank's work over this rank's)"
        return text + f"; HFU {p(self.hfu)} (every FLOP run, recomputation included)"

    def per_op(self, step: int = -1) -> list[dict]:
        """The step's compute by operation, slowest first: name, kind, count, device seconds, FLOPs, bytes and
        the fraction of peak it reached (its own dtype's). Device seconds: what the device spends on it, before
        the host's launches are set beside (`kernel_time`, rule 4)."""
        rows: dict = {}
        gpu = self.cluster.gpu
        for segment in (s.instruction for s in self.timelines[step].spans if s.kind == "compute"):
            for kernel, count in segment.kernels:
                row = rows.setdefault(
                    (kernel.name, kernel.dtype),
                    dict(
                        name=kernel.name,
                        kind=kernel.kind,
                        dtype=kernel.dtype,
                        count=0,
                        seconds=0.0,
                        flops=0.0,
                        bytes=0.0,
                    ),
                )
                row["count"] += count
                row["seconds"] += count * device_seconds(gpu, kernel)
                row["flops"] += count * kernel.flops
                row["bytes"] += count * kernel.bytes
        for row in rows.values():
            peak = gpu.peak_flops.get(row["dtype"], 0.0)
            row["fraction_of_peak"] = row["flops"] / row["seconds"] / peak if row["seconds"] and peak else 0.0
        return sorted(rows.values(), key=lambda r: -r["seconds"])

    @property
    def trust(self) -> str | None:
        """How far to trust this prediction: where the cluster was measured (`toolkit.sim.calibrate.trust`), the
        calibration's spread, the load then and now; on a GPU preset, how its predictions fared against published
        training runs (`held_to_runs`); None elsewhere."""
        found = self.cluster.notes.get("trust")
        return found["note"] if found else held_to_runs.note(self.cluster)

    def summary(self) -> str:
        """The step's time and rate; for a job that does not fit, the verdict instead of a time."""
        if self.fit is not None and not self.fit.fits:
            return f"{self.cluster.name}: {self.fit.text()}"
        b, t = self.breakdown, seconds_text
        how = "per-operation model" if self.mfu_override is None else f"at {self.mfu_override:.0%} of peak"
        band = self.band
        spread = (
            ""
            if band["worst"] == band["best"]
            else f" (band {t(band['best'])} to {t(band['worst'])} from the spread of its sources)"
        )
        text = (
            f"{self.cluster.name}, {self.dtype}, {how}: {parts.text(b)}{spread}; "
            f"{t(b['overlapped_comm'])} of communication hidden behind compute; "
            f"{flops_text(self.tflops_per_gpu * 1e12)} per GPU"
        )
        if abs(self.share - 1) > 1e-3:
            text += (
                f" (all ranks' work / {self.run.meta['world_size']}; rank {self.run.ranks[0]}'s own: "
                f"{flops_text(self.rank_tflops * 1e12)})"
            )
        text += ", " + self.utilisation_text()
        if self.fit is not None:
            text += f"; {self.fit.text()}"
        return text + (f"\n  trust: {self.trust}" if self.trust else "")


def slowdown(cluster: Cluster) -> float:
    """How much longer compute runs beside collectives on `cluster` (the overlap rule's rule 6): measured on the
    presets (`published_collectives.OVERLAP_SLOWDOWN`), none elsewhere."""
    return cluster.published.overlap_slowdown.value if cluster.published is not None else 0.0


def estimate(
    programs,
    cluster="dgx-a100",
    *,
    world_size: int,
    rank: int = 0,
    mfu: float | None = None,
    dtype: str = "bf16",
    config: dict | None = None,
) -> StepCost:
    """Price each step's program on `cluster` (a preset name, a dict or a Cluster); steps run back to back."""
    found = cluster if isinstance(cluster, Cluster) else cluster_of(cluster)
    found.check_world(world_size)
    override = None if mfu is None else check_mfu(mfu)
    found.gpu.flops_per_s(dtype)  # an unknown dtype fails here, before any work
    programs = list(programs)
    if not programs:
        raise ValueError("estimate needs at least one step's program (sim.programs is empty).")
    cost = StepCost(found, dtype, override)  # its cache: Kernel -> device seconds (a model's layers repeat them)
    cost.reprice = lambda other: estimate(
        programs, other, world_size=world_size, rank=rank, mfu=mfu, dtype=dtype, config=config
    )

    def seconds(segment):
        return compute_time(segment, found.gpu, dtype, override, cost.cache)

    def comm(c):
        return collective_time(found, c.op, c.size_bytes, c.group, rank, c.args)

    clock = 0.0
    for program in programs:
        check(program)
        timeline = schedule(
            program,
            seconds,
            comm,
            start=clock,
            overlap=found.overlap,
            beside=found.beside_compute,
            slowdown=slowdown(found),
        )
        cost.timelines.append(timeline)
        cost.flops.append(total_flops(program))
        cost.model_flops.append(model_flops(program))
        clock = timeline.end
    cost.run = modelled_run(
        cost.timelines,
        found,
        rank=rank,
        world_size=world_size,
        config=dict(config or {}, cluster=found.name, dtype=dtype, mfu=override),
    )
    return cost
