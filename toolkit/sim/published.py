"""Published measurements of the hardware: the record each is kept in, and how a prediction's band reads them.

Nothing measured here was measured on, or chosen to match, a training run the simulator is judged against
(Megatron-LM's Table 1, the FSDP paper, llm-foundry's tables, torchtitan's, NeMo's): these are kernels and collectives
timed alone, by their vendors or by third parties, on the GPUs and networks of the presets. The numbers themselves
are in `published_kernels.py` (GEMMs, HBM, attention: `A100`, `H100`) and `published_collectives.py` (nccl-tests,
the network cards, compute beside NCCL: `DGX_A100`, `DGX_H100`); `kernel_time` and `collective_time` read them;
`docs/differences.md` ("Pricing from published measurements") lists them with their uses.

Every number is a `Measured`: the value the model uses, and the two ends of what the sources say (`worst`, `best`:
the slower and the faster end for a step). `at(obj, "worst")` swaps every Measured inside a preset for one of its
ends, which is how a prediction's band is priced (`cost.StepCost.band`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Measured:
    """A published number: `value` as the model uses it, `worst` and `best` the slow and fast ends of its sources."""

    value: float
    worst: float
    best: float
    source: str

    def end(self, which: str) -> Measured:
        x = {"worst": self.worst, "best": self.best, "value": self.value}[which]
        return Measured(x, x, x, self.source)


def at(obj, which: str):
    """`obj` (a dataclass, dict or tuple holding Measured numbers, however deep) with each at one end: "worst",
    "best" or "value"."""
    if isinstance(obj, Measured):
        return obj.end(which)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: at(getattr(obj, f.name), which) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, dict):
        return {k: at(v, which) for k, v in obj.items()}
    if isinstance(obj, tuple) and any(isinstance(v, Measured) for v in obj):
        return tuple(at(v, which) for v in obj)
    return obj


@dataclass(frozen=True)
class GpuMeasurements:
    """What prices a GPU's kernels beyond its datasheet (`kernel_time`). Rates are fractions of the datasheet's (of
    the 16-bit tensor-core peak, of the HBM bandwidth), so that a preset with other datasheet numbers (A100 40GB's
    HBM) or a what-if scales with them."""

    gemm_shape: tuple  # (batch, m, n, k) of the GEMM whose rate sets the SMs' mainloop rate
    gemm_rate: Measured  # its FLOP/s over the peak, 16-bit inputs (cuBLAS/cuBLASLt, random data, warmed up)
    gemm_ceiling: Measured  # the fastest GEMM a search of shapes found, over the peak: no shape runs faster
    gemm_stages: int  # the GEMM kernels' pipeline stages (a k-block each; all but one fill before the first)
    hbm: Measured  # bytes/s a streaming kernel reaches over the datasheet's (STREAM-like kernels)
    attention: dict  # (causal, head_dim) -> ((sequence length, TFLOP/s forward + backward), ...)
    attention_scale: Measured  # another measurement's ratio to the attention table (the table's spread)
    attention_tokens: int = 16384  # the benchmark's batch x sequence length (hidden 2048: heads = 2048 / head_dim)


@dataclass(frozen=True)
class NetworkMeasurements:
    """What prices a cluster's collectives (`collective_time`)."""

    all_reduce_busbw: tuple  # ((message bytes, bus GB/s), ...): nccl-tests all_reduce inside one node of 8 GPUs
    nvlink: float  # the datasheet's NVLink bytes/s per direction the table was measured on (its scale)
    ring_over_all_reduce: Measured  # bus bandwidth of the other ring collectives over all_reduce's, inside a node
    p2p: Measured  # a send between two GPUs of a node over the datasheet's NVLink (p2pBandwidthLatencyTest)
    nic: Measured  # bytes/s one GPU's network card reaches in NCCL, over the card's datasheet rate
    overlap_slowdown: Measured  # how much longer compute takes while NCCL kernels share the SMs (0.189: 18.9%)
