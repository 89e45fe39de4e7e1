"""What a simulation leaves: one rank's step, exactly as its strategy ran it, and readings of it.

The contract lessons and tests build on (all for the simulated rank):

    memory          {"params", "grads", "optimizer", "total"}: the ledger at the end of the last step,
                    after the optimizer's update and before `zero_grad` (every model state alive)
    peak            bytes: the highest total during the steps; peak_memory by category, peak_moment
                    ({"phase", "module", "pass"}) when it happened; moments: the highest total's categories at
                    each (pass, phase, module) of the step (what `sweep.extrapolate` matches across depths)
    bytes_per_step  {op: bytes sent, "total": ...} in the last step (ring accounting, as the door
                    counts them; the total equals `toolkit.trace.analysis.bytes_per_step` of a real run)
    message_bytes   {op: bytes of the messages handed to the collectives} in the last step
    num_params      the whole model's parameters (every rank's experts counted once); expert_params:
                    how many of them are MoE experts, split over `expert_parallel` ranks (this rank
                    holds local_expert_params of them)
    flops           FLOPs of the last step (torch's flop_registry, `record.py`), programs: one per step, run: the Run
    useful_flops    the average rank's FLOPs in the last step: all ranks' work / world size (differs
                    from `flops`, this rank's own, where ranks compute different numbers of MoE rows)
    accumulation    the micro-batches of a step (batch_per_rank sequences in all), and no_sync: whether all but the
                    last ran inside the strategy's no_sync() (`simulate(accumulation=, no_sync=)`)

Priced on a cluster (`simulate(..., cluster=...)`, `cost.pricer`) it also holds `fit` (`fit.Fit`: the peak
against the accelerator's memory, the headroom, what would make it fit), `fits`, `cost`, `modelled_run`,
and, when it fits, `step_time`, `breakdown`, `tflops_per_gpu` and `mfu` (None when it does not fit).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..memory import formulas
from ..run import Run
from ..trace import analysis  # noqa: F401 (toolkit.trace.analysis comes with the simulator, as lessons and tests use it)
from ..units import bytes_text, count_text
from .program import Collective, Compute, collectives, total_flops


@dataclass
class Simulation:
    strategy: str
    world_size: int
    rank: int
    ranks_per_node: int
    options: dict
    num_params: int
    expert_params: int
    expert_parallel: int
    local_expert_params: int
    batch_per_rank: int
    seq_len: int
    programs: list
    memory: dict
    peak: int
    peak_memory: dict
    peak_moment: dict
    end_memory: dict
    run: Run
    samples: list = field(default_factory=list)
    moments: dict = field(default_factory=dict)  # (pass, phase, module) -> bytes per category at its highest
    expert_row_flops: dict = field(default_factory=dict)  # MoE layer name -> forward FLOPs of a row, whole expert
    fit: object = None  # set when priced on a cluster (`cost.pricer`)
    accumulation: int = 1  # micro-batches a step, `batch_per_rank` sequences in all
    no_sync: bool = True  # all but a step's last micro-batch inside the strategy's no_sync()

    @property
    def fits(self):
        """True/False against the pricing cluster's accelerator memory; None when not priced on one."""
        return None if self.fit is None else self.fit.fits

    # --- communication -----------------------------------------------------------------------------
    def collectives(self, step: int = -1) -> list[Collective]:
        return collectives(self.programs[step])

    @property
    def bytes_per_step(self) -> dict:
        """{op: bytes this rank sent, "total"} in the last step (ring algorithm accounting)."""
        out: dict = {}
        for c in self.collectives():
            out[c.op] = out.get(c.op, 0) + c.bytes_sent
        out["total"] = sum(out.values())
        return out

    @property
    def message_bytes(self) -> dict:
        """{op: bytes of the messages handed to the door} in the last step (the collective's own size)."""
        out: dict = {}
        for c in self.collectives():
            out[c.op] = out.get(c.op, 0) + c.size_bytes
        return out

    @property
    def bytes_per_phase(self) -> dict:
        """The last step's bytes sent by phase, {"forward": b, ..., "total": b}, from its program (what
        `toolkit.trace.analysis.bytes_per_step` reads from a real Run; a pipeline's program may be put together
        for more micro-batches than its Run simulated: `toolkit.sim.stage_assembly`)."""
        out = {"total": 0}
        for c in self.collectives():
            out[c.phase] = out.get(c.phase, 0) + c.bytes_sent
            out["total"] += c.bytes_sent
        return out

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    @property
    def cross_node_bytes(self) -> int:
        """Bytes sent in the last step by collectives whose group spans more than one node.

        As the FSDP paper counts per-GPU cross-host traffic: a ring over ranks on several nodes is charged
        in full (how the hops map onto NICs is the cost model's business). A pipeline's send crosses the network
        when its peer is on another node (its group is the whole pipeline's)."""

        def ends(c):
            return (self.rank, c.args["peer"]) if c.op in ("send", "recv") and "peer" in c.args else c.group

        return sum(c.bytes_sent for c in self.collectives() if len({self.node_of(r) for r in ends(c)}) > 1)

    @property
    def flops(self) -> float:
        return total_flops(self.programs[-1])

    @property
    def useful_flops(self) -> float:
        return self.useful_flops_per_step()[-1]

    def useful_flops_per_step(self) -> list[float]:
        """Each step's FLOPs of the average rank: all ranks' work / world size.

        Ranks differ only in their MoE experts' rows (a rank holding a popular expert computes more; a
        shadowed expert's rows are computed by their senders). Every rank routes its tokens the same way
        here, so the average rank's experts compute the rows one rank routed and kept, through a whole
        expert; this rank's forward expert FLOPs are read from its program (the layer's "experts" spans).
        A row costs its forward once per call of the layer (a recomputation under activation checkpointing
        is a second call) and twice that in backward (the input's and the weights' gradients)."""
        steps = sorted({m["step"] for m in self.run.metrics if m["name"].endswith("/load")})[-len(self.programs) :]
        out = []
        for i, program in enumerate(self.programs):
            useful = total_flops(program)
            for name, row_flops in self.expert_row_flops.items():
                loads = [
                    m["value"]
                    for m in self.run.metrics
                    if m["name"] == f"moe/{name}/load" and steps and m["step"] == steps[min(i, len(steps) - 1)]
                ]
                if not loads:
                    continue
                spans = (f"moe/{name}/experts", f"moe/{name}/shadowed experts")
                mine = sum(
                    c.flops
                    for c in program
                    if isinstance(c, Compute)
                    and c.phase == "forward"
                    and any(n in spans and not a.get("backward") for _, n, _, a in c.spans)
                )
                useful += (sum(loads[0]["kept"]) * row_flops - mine) * (len(loads) + 2)
            out.append(useful)
        return out

    # --- the theory next to it ---------------------------------------------------------------------
    def theory(self) -> dict:
        """What `toolkit.memory.formulas` predicts for this model, strategy and world size.

        model_states: (2+2+K)Ψ under the strategy's ZeRO stage, with the bytes per value of the run (16-bit
        with mixed precision, else 4) and K = 12 with mixed precision (fp32 masters and Adam) or 8 (Adam)
        in fp32; fsdp as stage 3 over its sharding group, its fp32 shards counted 4 + 4 + 8;
        bytes_per_step: passes x Ψ x bytes x (N-1)/N over the sharding group (hybrid sharding adds its replica
        all-reduce). MoE experts are kept whole by their owners and travel as tokens (all-to-all), not in these bytes.
        Tensor parallelism: `sim/tensor_parallel.theory`. Context parallelism adds the ring's (or Ulysses') bytes
        and divides the tokens of a rank by cp (`sim/context_parallel.py`).
        """
        found = self._theory()
        cp = getattr(self, "context_parallel", None)
        if cp:
            found["flops_6PT"] /= cp["cp"]
            found["bytes_per_step"] += cp["bytes"] or 0
        return found

    def _theory(self) -> dict:
        if getattr(self, "tensor_parallel", None):
            from .tensor_parallel import theory

            return theory(self)
        from ..parallel.fsdp_unit import dtypes

        param_dtype, reduce_dtype = dtypes(self.options.get("mixed_precision", False))
        mixed = param_dtype != torch.float32
        value, reduced = param_dtype.itemsize, reduce_dtype.itemsize  # ZeRO-1/2's main gradients: fp32
        K = 12 if mixed else 8
        stage = {"local": 0, "dp": 0, "ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}[self.strategy]
        F = (self.options.get("sharding_group_size") or self.world_size) if self.strategy == "fsdp" else self.world_size
        kept = (4, 4, 8) if self.strategy == "fsdp" else (value, reduced, K)  # FSDP keeps fp32 shards: 4 + 4 + 8
        dense = self.num_params - self.expert_params  # experts: each rank keeps its own, whole
        states = formulas.model_states_breakdown(
            dense, F, stage, param_bytes=kept[0], grad_bytes=kept[1], optimizer_multiplier=kept[2]
        )
        mine = formulas.model_states_breakdown(
            self.expert_params / self.expert_parallel,
            1,
            0,
            param_bytes=kept[0],
            grad_bytes=kept[1],
            optimizer_multiplier=kept[2],
        )
        states = {k: v + mine[k] for k, v in states.items()}
        loop = dict(accumulation=self.accumulation, no_sync=self.no_sync)
        wire = formulas.communication_per_step(dense, F, self.strategy, **loop) * value
        reductions = formulas.gradient_reductions(self.strategy, **loop)
        if self.strategy in ("zero1", "zero2", "zero3", "fsdp"):  # one pass of the ring is the gradients' reduction
            wire += dense * (F - 1) / F * (reduced - value) * reductions
        if self.strategy == "fsdp" and F < self.world_size:  # the replicas' shards
            wire += formulas.ring_all_reduce_bytes(dense / F * reduced, self.world_size // F) * reductions
        return {
            "model_states": states,
            "model_states_total": sum(states.values()),
            "bytes_per_step": wire,
            "flops_6PT": 6 * self.num_params * self.batch_per_rank * self.seq_len,
        }

    def summary(self) -> str:
        """A few lines a person reads: memory against the formula, the peak and whether it fits, bytes against
        theory, FLOPs. Units follow the magnitude (a tiny model reads in kB, GPT-3 in GB)."""
        t = self.theory()
        b = lambda n: f"{bytes_text(n):>10}"  # noqa: E731
        tp, cp = getattr(self, "tensor_parallel", None), getattr(self, "context_parallel", None)
        layout = (
            ""
            if not tp
            else (
                f" over dp={tp['dp']} x tp={tp['tp']}"
                + (" with sequence parallelism" if tp["sequence_parallel"] else "")
                + {True: ", its communication overlapped", "backward": ", its backward's communication overlapped"}.get(
                    tp.get("comm_overlap"), ""
                )
            )
        )
        if cp:
            layout += (
                f" x cp={cp['cp']} ({cp['attention']})"
                if tp
                else f" over dp={cp['dp']} x cp={cp['cp']} ({cp['attention']})"
            )
        micro = f" in {self.accumulation} micro-batches" + ", each one's gradients reduced" * (not self.no_sync)
        lines = [
            f"{self.strategy}{layout} on {self.world_size} simulated ranks (rank {self.rank}, {self.ranks_per_node} "
            f"per node): {count_text(self.num_params)} parameters, batch {self.batch_per_rank} x {self.seq_len}"
            + (" per data-parallel replica" if tp or cp else "")
            + micro * (self.accumulation > 1),
            f"  model states per rank  {b(self.memory['total'])}   formula {b(t['model_states_total'])}",
        ]
        for k in ("params", "grads", "optimizer"):
            lines.append(f"    {k:<20} {b(self.memory[k])}   formula {b(t['model_states'][k])}")
        peak = ", ".join(f"{k} {bytes_text(v)}" for k, v in self.peak_memory.items() if v)
        where = self.peak_moment
        lines.append(
            f"  peak                   {b(self.peak)}   in {where.get('pass', '?')} at "
            f"{where.get('module') or '-'} ({peak})"
        )
        lines.append(
            "  "
            + (
                self.fit.text().replace("\n", "\n  ")
                if self.fit is not None
                else "does it fit? price it on a cluster (cluster='dgx-a100') to check the peak against "
                "its accelerator's memory"
            )
        )
        lines.append(f"  sent per rank per step {b(self.bytes_per_step['total'])}   theory {b(t['bytes_per_step'])}")
        for op, n in self.bytes_per_step.items():
            if op != "total":
                lines.append(f"    {op:<20} {b(n)}   (messages {bytes_text(self.message_bytes[op])})")
        lines.append(f"  across nodes           {b(self.cross_node_bytes)}")
        lines.append(f"  FLOPs per step         {self.flops:10.4g}   6·Ψ·tokens {t['flops_6PT']:.4g}")
        if abs(self.useful_flops - self.flops) > 1e-6 * self.flops:
            lines.append(
                f"  the average rank's     {self.useful_flops:10.4g}   (all ranks' work / {self.world_size}: "
                f"this rank computes {self.flops / self.useful_flops:.2f}x the average)"
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"Simulation({self.strategy!r}, world_size={self.world_size}, rank={self.rank}, "
            f"memory={bytes_text(self.memory['total'])}, peak={bytes_text(self.peak)}, "
            f"bytes_per_step={bytes_text(self.bytes_per_step['total'])}"
            + ("" if self.fit is None else f", fits={self.fit.fits}")
            + ")"
        )
