"""What a simulated step costs: its programs, priced on a cluster, as time, TFLOP/s and a modelled Run.

    cost = estimate(sim.programs, "dgx-a100", world_size=512, dtype="bf16")
    cost.step_time, cost.breakdown, cost.tflops_per_gpu, cost.mfu, cost.run

- Compute: a segment's FLOPs at the achievable fraction of the accelerator's peak (`mfu`, the preset's
  unless overridden), or its bytes at the memory's bandwidth when that is slower (a roofline), plus a
  fixed cost per operation where the preset has one (a CPU's dispatch; 0 on the GPU presets).
- Communication: `collective_time` on the cluster's links; overlap: `timeline.schedule`.
- The Run has the spans a real run's trace has, in the same order: "forward", "backward" and
  "optimizer" compute spans, one span per collective with the door's args, and a "wait" span wherever
  the compute stream stalls on an asynchronous collective; every event says `args.modelled=True`.
  So `toolkit.viz.timeline`, `toolkit.trace.analysis` and the Chrome export treat it as a real run.
"""
from __future__ import annotations

import platform
from dataclasses import dataclass, field

import torch

from ..run import Run
from ..units import seconds_text
from .collective_time import collective_time
from .hardware import THIS_MACHINE, Cluster, check_mfu, cluster_of
from .program import Compute, check, total_flops
from .timeline import Timeline, schedule


def compute_time(segment: Compute, gpu, dtype: str = "bf16", mfu: float | None = None) -> float:
    """Seconds for one compute segment: max(FLOPs at mfu x peak, bytes at memory bandwidth) + ops x overhead."""
    rate = gpu.flops_per_s(dtype) * (gpu.mfu if mfu is None else mfu)
    memory = segment.bytes / gpu.memory_bandwidth if segment.bytes else 0.0
    return max(segment.flops / rate, memory) + segment.ops * gpu.op_overhead


@dataclass
class StepCost:
    """The modelled cost of a simulated rank's steps (the last one is the steady state reported)."""
    cluster: Cluster
    dtype: str
    achievable_mfu: float               # the fraction of peak compute was charged at
    timelines: list = field(default_factory=list)
    flops: list = field(default_factory=list)  # per step, this rank's own
    run: Run | None = None
    useful_flops: list | None = None    # per step, the average rank's: all ranks' work / world (None: = flops)
    fit: object = None                  # the peak against the accelerator's memory (`fit.Fit`), when known

    @property
    def step_time(self) -> float:
        return self.timelines[-1].step_time

    @property
    def step_times(self) -> list[float]:
        return [t.step_time for t in self.timelines]

    @property
    def breakdown(self) -> dict:
        """Seconds of the last step: compute, exposed_comm, overlapped_comm (and step, their compute + exposed)."""
        return self.timelines[-1].breakdown()

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
    def mfu(self) -> float:
        """Model FLOPs utilisation: the step's FLOPs over (step time x the accelerator's peak)."""
        return self.tflops_per_gpu * 1e12 / self.cluster.gpu.flops_per_s(self.dtype)

    def summary(self) -> str:
        """The step's time and rate; for a job that does not fit, the verdict instead of a time."""
        if self.fit is not None and not self.fit.fits:
            return f"{self.cluster.name}: {self.fit.text()}"
        b, t = self.breakdown, seconds_text
        peak = self.cluster.gpu.flops_per_s(self.dtype)
        at_rate = self.flops[-1] / (peak * self.achievable_mfu) / self.step_time  # share of the step at that rate
        text = (f"{self.cluster.name}: step {t(self.step_time)} = compute {t(b['compute'])} + exposed communication "
                f"{t(max(b['exposed_comm'], 0.0))} ({t(b['overlapped_comm'])} more hidden behind compute); "
                f"{self.tflops_per_gpu:.3g} TFLOP/s per GPU")
        ratio = self.tflops_per_gpu / self.rank_tflops if self.rank_tflops > 0 else 1.0
        if abs(ratio - 1) > 1e-3:
            text += f" (all ranks' work / {self.run.meta['world_size']}; rank {self.run.ranks[0]}'s own: " \
                    f"{self.rank_tflops:.3g})"
        text += (f", MFU {self.mfu:.1%} = {self.achievable_mfu:.0%} of the {self.dtype} peak (the rate compute is "
                 f"charged at) x {at_rate:.1%} of the step computing at that rate"
                 + (f" x {ratio:.2f} (the average rank's work over this rank's)" if abs(ratio - 1) > 1e-3 else "")
                 + "; the rest of the step: exposed communication"
                 + (", memory-bound operations and per-operation overhead" if at_rate * self.step_time < b["compute"] * 0.999
                    else ""))
        if self.fit is not None:
            text += f"; {self.fit.text()}"
        return text


def estimate(programs, cluster="dgx-a100", *, world_size: int, rank: int = 0, mfu: float | None = None,
             dtype: str = "bf16", config: dict | None = None) -> StepCost:
    """Price each step's program on `cluster` (a preset name, a dict or a Cluster); steps run back to back."""
    found = cluster if isinstance(cluster, Cluster) else cluster_of(cluster)
    found.check_world(world_size)
    achievable = found.gpu.mfu if mfu is None else check_mfu(mfu)
    found.gpu.flops_per_s(dtype)  # an unknown dtype fails here, before any work
    programs = list(programs)
    if not programs:
        raise ValueError("estimate needs at least one step's program (sim.programs is empty).")

    def seconds(segment):
        return compute_time(segment, found.gpu, dtype, achievable)

    def comm(c):
        return collective_time(found, c.op, c.size_bytes, c.group, rank, c.args)

    cost = StepCost(found, dtype, achievable)
    clock = 0.0
    for program in programs:
        check(program)
        timeline = schedule(program, seconds, comm, start=clock, overlap=found.overlap)
        cost.timelines.append(timeline)
        cost.flops.append(total_flops(program))
        clock = timeline.end
    cost.run = modelled_run(cost.timelines, found, rank=rank, world_size=world_size,
                            config=dict(config or {}, cluster=found.name, dtype=dtype, mfu=achievable))
    return cost


# --- a simulation, priced ------------------------------------------------------------------------------
def resolve(cluster, world_size: int) -> Cluster:
    """A Cluster from what a user passes; "this-machine" is calibrated for `world_size` ranks (cached)."""
    if isinstance(cluster, str) and cluster.lower() == THIS_MACHINE:
        from .calibrate import this_machine
        return this_machine(world_size)
    return cluster if isinstance(cluster, Cluster) else cluster_of(cluster)


def dtype_of(options: dict) -> str:
    """The dtype a strategy computes in: its mixed-precision option's 16-bit type, else fp32."""
    from ..parallel.fsdp_unit import dtypes

    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtypes(options.get("mixed_precision", False))[0], "fp32")


def _priced(sim, found: Cluster, mfu, dtype) -> StepCost:
    """The simulation's programs on `found`, whose nodes are taken to be the simulation's."""
    if found.gpus_per_node != sim.ranks_per_node:
        found = found.with_changes(gpus_per_node=sim.ranks_per_node)
    cost = estimate(sim.programs, found, world_size=sim.world_size, rank=sim.rank, mfu=mfu,
                    dtype=dtype or dtype_of(sim.options), config=sim.run.config)
    from .fit import check_fit

    cost.useful_flops, cost.fit = sim.useful_flops_per_step(), check_fit(sim, found)
    return cost


def pricer(cluster, world_size: int, *, mfu: float | None = None, dtype: str | None = None):
    """Check `cluster` and `mfu` now; return price(sim), which fills sim.cost, sim.fit, sim.modelled_run and, when
    the peak fits in the accelerator's memory, sim.step_time, sim.tflops_per_gpu, sim.mfu, sim.breakdown (None
    when it does not: it would not run). What `simulate(..., cluster=...)` does."""
    found = resolve(cluster, world_size)
    if mfu is not None:
        check_mfu(mfu)

    def price(sim) -> StepCost:
        cost = _priced(sim, found, mfu, dtype)
        sim.cost, sim.modelled_run, sim.fit = cost, cost.run, cost.fit
        ran = cost.fit.fits
        sim.step_time, sim.tflops_per_gpu, sim.mfu, sim.breakdown = (
            (cost.step_time, cost.tflops_per_gpu, cost.mfu, cost.breakdown) if ran else (None, None, None, None))
        return cost

    return price


def price(sim, cluster="dgx-a100", *, mfu: float | None = None, dtype: str | None = None) -> StepCost:
    """What a Simulation's steps would cost on another cluster (or at another mfu): a StepCost; `sim` is unchanged."""
    return _priced(sim, resolve(cluster, sim.world_size), None if mfu is None else check_mfu(mfu), dtype)


# --- the modelled Run ---------------------------------------------------------------------------------
def _compute_events(timeline: Timeline, step: int) -> list[dict]:
    """One compute span per run of consecutive instructions in one phase, as the training loop records
    "forward", "backward", "optimizer" (a phase's span covers the stalls inside it, as a real one does)."""
    events = []
    for s in timeline.spans:
        if s.kind == "comm":
            continue
        phase = s.instruction.phase
        last = events[-1] if events else None
        if last is not None and last["phase"] == phase:
            last["end"] = s.end
        else:
            last = {"name": phase, "cat": "compute", "phase": phase, "start": s.start, "end": s.end,
                    "args": {"modelled": True, "step": step, "flops": 0.0, "segments": 0}}
            events.append(last)
        if s.kind == "compute":
            last["args"]["flops"] += s.instruction.flops
            last["args"]["segments"] += 1
    return events + _span_events(timeline, step)


def _span_events(timeline: Timeline, step: int) -> list[dict]:
    """The strategy's own spans (an FSDP unit's forward, a MoE layer's experts, with their args), each from its
    first segment's start to its last one's end, as a real trace has them inside the phase's span."""
    spans: dict = {}
    for s in timeline.spans:
        if s.kind != "compute":
            continue
        for key, name, cat, args in s.instruction.spans:
            if name == s.instruction.phase:  # the loop's own "forward"/"backward"/"optimizer": above
                continue
            if key in spans:
                spans[key]["end"] = s.end
                spans[key]["args"]["flops"] += s.instruction.flops
            else:
                spans[key] = {"name": name, "cat": cat, "phase": s.instruction.phase, "start": s.start, "end": s.end,
                              "args": dict(args, modelled=True, step=step, flops=s.instruction.flops)}
    return list(spans.values())


def _comm_event(s, step: int) -> dict:
    c = s.instruction
    args = dict(c.args, group=list(c.group), size_bytes=c.size_bytes, bytes_sent=c.bytes_sent,
                bytes_recv=c.bytes_recv, async_op=c.async_op, impl=c.args.get("impl", "backend"),
                modelled=True, step=step, link=s.cost.link, modelled_s=s.end - s.start, queued_s=s.start - s.issued)
    if c.label:
        args["label"] = c.label  # the unit, MoE step or module that issued it (the door's own args stay as they were)
    return {"name": c.op, "cat": "comm", "phase": c.phase, "start": s.start, "end": s.end, "args": args}


def _wait_events(timeline: Timeline, step: int) -> list[dict]:
    """A "wait" span where compute stalls on an asynchronous collective, or runs its copies on the cores
    ("host", overlap < 1: not computing either, args.host=True). A synchronous one's own span, async_op=False,
    already says the rank was blocked, as in a real trace."""
    ops = {s.instruction.id: s.instruction for s in timeline.spans if s.kind == "comm"}
    return [{"name": "wait", "cat": "wait", "phase": s.instruction.phase, "start": s.start, "end": s.end,
             "args": {"op": ops[s.instruction.id].op, "modelled": True, "step": step,
                      **({"host": True} if s.kind == "host" else {})}}
            for s in timeline.spans if s.kind in ("wait", "host") and ops[s.instruction.id].async_op]


def modelled_run(timelines, cluster: Cluster, *, rank: int = 0, world_size: int = 1,
                 config: dict | None = None) -> Run:
    """The timelines of one rank's steps as a Run (events marked modelled), with a "step_time" metric per step."""
    events, metrics = [], []
    for step, timeline in enumerate(timelines):
        events += _compute_events(timeline, step)
        events += [_comm_event(s, step) for s in timeline.spans if s.kind == "comm"]
        events += _wait_events(timeline, step)
        metrics.append({"name": "step_time", "step": step, "value": timeline.step_time, "rank": rank})
        metrics.append({"name": "modelled_breakdown", "step": step, "value": timeline.breakdown(), "rank": rank})
    for e in events:
        e["rank"] = rank
    events.sort(key=lambda e: (e["start"], e["cat"] != "compute"))
    meta = {"world_size": world_size, "ranks": [rank], "backend": "simulated", "device": cluster.gpu.name,
            "torch": torch.__version__, "host": platform.node(), "clock_offset_s": 0.0, "emulated_link": None,
            "modelled": True, "cluster": cluster.describe()}
    return Run(dict(config or {}, kind="simulated"), events, [], metrics, meta)
