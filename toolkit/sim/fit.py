"""Does it fit? A simulated rank's peak memory against its accelerator's, and what would make it fit.

The simulated peak is exact for the tensors the step creates (`memory.py`); a real GPU also holds the
CUDA context and the caching allocator's fragmentation (typically 1-3 GB on an 80 GB card), which is
why a fit with less than a tenth of the memory to spare is called tight. A job that does not fit has
no step time: it would stop at its first peak with an out-of-memory error, so `cost.pricer` prices
it for what the program would take (`sim.cost`) but reports no step time, TFLOP/s or MFU.

What would make it fit is read from what the peak is made of:

- model states (params + grads + optimizer, 16 bytes per parameter with mixed-precision Adam): shard
  them (ZeRO-3 / FSDP keep (2+2+12)Ψ/N per GPU), over a larger group, or on more GPUs;
- activations and temporaries: activation checkpointing (`activation_checkpointing=True`, an option of every
  strategy: each block keeps its input and recomputes the rest in backward), a smaller batch per GPU,
  shorter sequences;
- gathered units (ZeRO-3, FSDP): smaller units, or no prefetch (one unit fewer in flight).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..memory import model_states
from ..parallel.checkpointing import ATTENTION, BY_OPERATION
from ..units import bytes_text, memory_text

STATE_BYTES = 16  # per parameter: 2 + 2 + 12 (mixed precision) = 4 + 4 + 8 (fp32 Adam) = FSDP's fp32 shards
TIGHT = 0.1  # a fit with less than this fraction of the memory to spare


@dataclass(frozen=True)
class Fit:
    """The verdict: `peak` bytes on the simulated rank against `capacity` bytes of its `device`."""

    peak: float
    capacity: float
    device: str
    advice: tuple = field(default_factory=tuple)

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity

    @property
    def headroom(self) -> float:
        """Bytes to spare at the peak (negative: how much is missing)."""
        return self.capacity - self.peak

    @property
    def tight(self) -> bool:
        return self.fits and self.headroom < TIGHT * self.capacity

    def text(self) -> str:
        """One line (and, when it does not fit, what would make it fit)."""
        where = f"{self.device}'s {memory_text(self.capacity)}"
        if self.fits:
            spare = f"{bytes_text(self.headroom)} to spare"
            if self.tight:
                spare += " (tight: the CUDA context and the allocator's fragmentation take 1-3 GB of it)"
            return f"fits in the {where}: peak {bytes_text(self.peak)}, {spare}"
        lines = [
            f"DOES NOT FIT in the {where}: peak {bytes_text(self.peak)}, {bytes_text(-self.headroom)} over. "
            f"Not priced: it would stop at its first peak (out of memory). To fit:"
        ]
        return "\n".join(lines + [f"  - {a}" for a in self.advice])


def capacity(cluster, world_size: int) -> float:
    """Bytes one rank may use: its accelerator's memory; on "this-machine" the RAM, shared by all its ranks (an
    emulated link may split them into "nodes", but they all run on this one computer)."""
    memory = float(cluster.gpu.memory_bytes)
    if cluster.name.startswith("this-machine"):
        return memory / max(1, world_size)
    return memory


def check_fit(sim, cluster) -> Fit:
    """The verdict for a Simulation (or anything with its fields: peak, peak_memory, strategy, options, ...)."""
    room = capacity(cluster, sim.world_size)
    found = Fit(float(sim.peak), room, cluster.gpu.name)
    if found.fits:
        return found
    return Fit(found.peak, room, found.device, tuple(advice(sim, room)))


def _smaller(now: int, transient: float, excess: float, power_of_two: bool = False) -> str:
    """The largest value of a size that activations grow with (at least linearly) that takes `excess` bytes off
    `transient` (a power of two: sequence lengths), said as a suggestion; where even 1 would not, 1 and that it is
    not enough alone."""
    value = int(now * (1 - excess / transient)) if transient > 0 else 0
    if power_of_two and value >= 1:
        value = 2 ** (value.bit_length() - 1)
    return f"{value} or less" if value > 1 else "1" if value == 1 else "1, not enough alone"


def _more_micro_batches(sim, micro: int, transient: float, excess: float) -> str:
    """The step's batch in more micro-batches (gradient accumulation): the fewest that take `excess` bytes off
    `transient`, which grows with the micro-batch, said as a suggestion (where even one sequence would not, that)."""
    fits = int(micro * (1 - excess / transient)) if transient > 0 else 0  # the largest micro-batch that would do
    batch = sim.batch_per_rank
    more = [m for m in range(sim.accumulation + 1, batch + 1) if batch % m == 0 and batch // m <= max(fits, 1)]
    n = batch // more[0]
    return (
        f"the same batch in smaller micro-batches (accumulation={more[0]}, {n} sequence{'s' * (n > 1)} a pass, "
        f"now {micro}{'' if fits >= 1 else ', not enough alone'}; activations scale with the micro-batch, and "
        f"one optimizer step follows them all)"
    )


def advice(sim, room: float) -> list[str]:
    """What would bring `sim`'s peak under `room` bytes, the largest part of the peak first."""
    parts = sim.peak_memory
    states = sum(parts.get(k, 0) for k in ("params", "grads", "optimizer"))
    transient = parts.get("activations", 0) + parts.get("temporary", 0)
    gathered = parts.get("gathered", 0)
    world, options = sim.world_size, sim.options
    dense, experts = sim.num_params - sim.expert_params, sim.expert_params / max(1, sim.expert_parallel)
    group = (options.get("sharding_group_size") or world) if sim.strategy == "fsdp" else world
    sharded = (
        model_states(dense, world, 3, param_bytes=2, grad_bytes=2, optimizer_multiplier=12) + STATE_BYTES * experts
    )
    tips = []
    if sim.strategy in ("local", "dp", "ddp", "zero1", "zero2") and sharded < states:
        tips.append(
            (
                states,
                f"shard the model states: under zero3 or fsdp they take {bytes_text(sharded)} per GPU "
                f"at {world} GPUs ((2+2+12)Ψ/N); here {bytes_text(states)} of the peak",
            )
        )
    elif sim.strategy == "fsdp" and group < world and sharded < states:
        tips.append(
            (
                states,
                f"a larger sharding group: over {group} GPUs the model states take {bytes_text(states)} "
                f"per GPU, over all {world} {bytes_text(sharded)} (sharding_group_size)",
            )
        )
    if states > 0.5 * room:
        need = (
            math.ceil(STATE_BYTES * dense / max(1.0, 0.5 * room - STATE_BYTES * experts))
            if 0.5 * room > STATE_BYTES * experts
            else None
        )
        if need and need > world:
            tips.append(
                (
                    states,
                    f"more GPUs: sharded, the model states alone ({STATE_BYTES}Ψ = "
                    f"{bytes_text(STATE_BYTES * dense)}) take half of the memory at about {need} GPUs",
                )
            )
    if transient:
        what = f"activations and temporaries take {bytes_text(transient)} of the peak"
        flag = options.get("activation_checkpointing", False)
        if flag != 1:  # short of every block, whole (True is 1)
            now = {False: "", BY_OPERATION: ", now by operation", ATTENTION: ", now its core attention only"}.get(
                flag, f", now one block in {flag}"
            )
            tips.append(
                (
                    transient,
                    f"activation checkpointing{' of every block' if flag else ''} (activation_checkpointing=True"
                    f"{now}): {what}; it keeps each block's input and recomputes the rest in backward",
                )
            )
        excess = sim.peak - room
        micro = sim.batch_per_rank // sim.accumulation
        if micro > 1 and options.get("pp", 1) == 1:
            tips.append((transient, _more_micro_batches(sim, micro, transient, excess)))
        elif sim.batch_per_rank > 1:
            smaller = _smaller(sim.batch_per_rank, transient, excess)
            tips.append(
                (
                    transient,
                    f"a smaller batch per GPU (batch_per_rank={smaller}, now {sim.batch_per_rank}; "
                    f"activations scale with it)",
                )
            )
        else:
            shorter = _smaller(sim.seq_len, transient, excess, power_of_two=True)
            tips.append(
                (
                    transient / 2,
                    f"shorter sequences (seq_len={shorter}, now {sim.seq_len}; activations grow "
                    f"with it, attention's scores with its square where they are kept)",
                )
            )
    if gathered:
        tips.append(
            (
                gathered,
                f"smaller units (gathered parameters take {bytes_text(gathered)} at the peak)"
                + (", or no forward_prefetch (one unit fewer in flight)" if options.get("forward_prefetch") else ""),
            )
        )
    matters = min(sim.peak - room, 0.1 * sim.peak)  # a part smaller than both cannot be what is wrong
    return [text for part, text in sorted(tips, key=lambda t: -t[0]) if part >= matters]
