"""The presets: the DGX A100 and DGX H100 clusters and their GPUs, each number with its source.

Sources (dense math, no sparsity); nothing here is fitted to a training run:
- A100 SXM: 312 TFLOP/s bf16/fp16, 19.5 TFLOP/s fp32; 40 GB HBM2 at 1,555 GB/s or 80 GB HBM2e at
  2,039 GB/s; 108 SMs (NVIDIA A100 datasheet and whitepaper). H100 SXM: 989 TFLOP/s bf16, 67 TFLOP/s
  fp32, 80 GB HBM3 at 3.35 TB/s, 132 SMs (NVIDIA H100 datasheet).
- How fast their kernels and collectives run beyond the datasheet: published measurements, each with its source and
  spread (`published_kernels.py`, `published_collectives.py`): GEMMs by shape (cuBLASLt / XLA's sweeps, the best shape
  of a search), FlashAttention-2's rates, STREAM-like HBM bandwidth, nccl-tests' bus bandwidth by message size, the
  network cards' achievable rate in NCCL, and how much compute slows beside NCCL's kernels.
- Host work per operation (`op_overhead`, dispatch and launch): 5 us on the GPU presets, what the
  calibration measures for PyTorch's eager dispatch of a tiny operation on a CPU (4.8-5.8 us,
  docs/benchmarks.md); it hides behind any kernel longer than that (the host runs ahead of a GPU).
- NVLink: A100 600 GB/s, H100 900 GB/s per GPU, both directions added (half each way); DGX A100 has
  8 x 200 Gb/s InfiniBand HDR per node (one per GPU), DGX H100 8 x 400 Gb/s NDR.
- Latencies: NCCL's own tuning model (src/graph/tuning.cc, ring with the Simple protocol): 8.4 us per
  call, 3.4 us per step over NVLink, 9.6 us per step across the network (between nodes; inside a node the
  measured bus bandwidth by message size carries its own latency).
A step's compute time is then each recorded operation priced on these (`toolkit.sim.kernel_time`):
what an end-to-end measurement such as Megatron-LM's 163 of 312 TFLOP/s reaches is an outcome of the
model, which `tests/test_sim_papers.py` holds against the papers, not an input.
"""

from __future__ import annotations

from ..comm.emulate import Link
from . import published_collectives, published_kernels
from .hardware_records import Accelerator, Cluster

GB, GiB = 1e9, 2**30

_A100 = dict(
    peak_flops={"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    sms=108,
    op_overhead=5e-6,
    matmul_efficiency=published_kernels.A100_GEMM.value,
    published=published_kernels.A100,
)
_H100 = dict(
    peak_flops={"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    sms=132,
    op_overhead=5e-6,
    matmul_efficiency=published_kernels.H100_GEMM.value,
    published=published_kernels.H100,
)
_SOURCES = "; kernels: toolkit.sim.published_kernels"
GPUS = {
    "a100-40gb": Accelerator(
        "A100 SXM 40GB",
        memory_bytes=40 * GiB,
        memory_bandwidth=1555 * GB,
        **_A100,
        source="NVIDIA A100 datasheet and whitepaper" + _SOURCES + " (measured on the 80GB; "
        "its HBM at the same fraction of the datasheet)",
    ),
    "a100-80gb": Accelerator(
        "A100 SXM 80GB",
        memory_bytes=80 * GiB,
        memory_bandwidth=2039 * GB,
        **_A100,
        source="NVIDIA A100 datasheet and whitepaper" + _SOURCES,
    ),
    "h100-sxm": Accelerator(
        "H100 SXM 80GB",
        memory_bytes=80 * GiB,
        memory_bandwidth=3350 * GB,
        **_H100,
        source="NVIDIA H100 datasheet" + _SOURCES,
    ),
}
_NCCL = "latencies: NCCL src/graph/tuning.cc (ring, Simple): 8.4 us/call, 3.4 us/NVLink step, 9.6 us/network step"
CLUSTERS = {
    "dgx-a100": Cluster(
        "dgx-a100",
        GPUS["a100-80gb"],
        8,
        Link(300 * GB, 3.4e-6),
        Link(25 * GB, 9.6e-6),
        8.4e-6,
        source="DGX A100: NVLink3 600 GB/s per GPU (300 each way), 8 x 200 Gb/s HDR InfiniBand; "
        + _NCCL
        + "; collectives: toolkit.sim.published_collectives",
        published=published_collectives.DGX_A100,
        links_share=True,
    ),
    "dgx-h100": Cluster(
        "dgx-h100",
        GPUS["h100-sxm"],
        8,
        Link(450 * GB, 3.4e-6),
        Link(50 * GB, 9.6e-6),
        8.4e-6,
        source="DGX H100: NVLink4 900 GB/s per GPU (450 each way), 8 x 400 Gb/s NDR InfiniBand; "
        + _NCCL
        + "; collectives: toolkit.sim.published_collectives",
        published=published_collectives.DGX_H100,
        links_share=True,
    ),
}
THIS_MACHINE = "this-machine"


def presets() -> dict:
    """The named clusters `simulate(..., cluster=...)` accepts, each with a one-line description."""
    out = {name: c.describe() for name, c in CLUSTERS.items()}
    out[THIS_MACHINE] = (
        "this computer, calibrated once by measurement (GEMM FLOP/s by size, per-operation "
        "overhead, memory bandwidth, loopback alpha-beta of the collectives as a step calls them, "
        "the fraction of a collective that hides behind compute and how much longer one takes "
        "beside compute) and cached on disk"
    )
    return out
