"""The hardware a simulated step runs on: accelerators and clusters, each a small record with its source.

A cluster is two levels of links, as a DGX-style machine room is: `gpus_per_node` accelerators joined
by NVLink/NVSwitch inside a node (`intra`), and one network card per accelerator between nodes
(`inter`). Every bandwidth is per accelerator and per direction; every latency is what one step of a
ring pays on that kind of link (alpha), plus `call_latency` once per collective call.

    toolkit.sim.presets()                      # {'dgx-a100': '...', 'dgx-h100': '...', 'this-machine': '...'}
    toolkit.sim.cluster_of("dgx-a100")         # a Cluster
    toolkit.sim.cluster_of(dict(name="fsdp-paper", gpu="a100-80gb", gpus_per_node=8,
                                intra=("300 GB/s", "3.4 us"), inter=("250 Gb/s", "9.6 us")))

Sources (dense math, no sparsity); nothing here is fitted to a training run:
- A100 SXM: 312 TFLOP/s bf16/fp16, 19.5 TFLOP/s fp32; 40 GB HBM2 at 1,555 GB/s or 80 GB HBM2e at
  2,039 GB/s; 108 SMs (NVIDIA A100 datasheet and whitepaper). H100 SXM: 989 TFLOP/s bf16, 67 TFLOP/s
  fp32, 80 GB HBM3 at 3.35 TB/s, 132 SMs (NVIDIA H100 datasheet).
- How fast their kernels and collectives run beyond the datasheet: published measurements, each with its source
  and spread (`toolkit.sim.published`): GEMMs by shape (cuBLASLt / XLA's sweeps, the best shape of a search),
  FlashAttention-2's rates, STREAM-like HBM bandwidth, nccl-tests' bus bandwidth by message size, the network
  cards' achievable rate in NCCL, and how much compute slows beside NCCL's kernels.
- Host work per operation (`op_overhead`, dispatch and launch): 5 us on the GPU presets, what the
  calibration measures for PyTorch's eager dispatch of a tiny operation on a CPU (4.8-5.8 us,
  docs/benchmarks.md); it hides behind any kernel longer than that (the host runs ahead of a GPU).
- NVLink: A100 600 GB/s, H100 900 GB/s per GPU, both directions added (half each way); DGX A100 has
  8 x 200 Gb/s InfiniBand HDR per node (one per GPU), DGX H100 8 x 400 Gb/s NDR.
- Latencies: NCCL's own tuning model (src/graph/tuning.cc, ring with the Simple protocol): 8.4 us per
  call, 3.4 us per step over NVLink, 9.6 us per step across the network (between nodes; inside a node the
  measured bus bandwidth by message size carries its own latency).
A user-defined accelerator or cluster (a dict) has no measurements: it is priced at its datasheet numbers
(`matmul_efficiency` x peak for GEMMs, the full HBM and link bandwidths, the alpha-beta model of its links).
A step's compute time is then each recorded operation priced on these (`toolkit.sim.kernel_time`):
what an end-to-end measurement such as Megatron-LM's 163 of 312 TFLOP/s reaches is an outcome of the
model, which `tests/test_sim_papers.py` holds against the papers, not an input.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..comm.emulate import Link, parse_bandwidth, parse_latency
from . import published as measured
from .published import GpuMeasurements, NetworkMeasurements

GB, GiB = 1e9, 2**30


@dataclass(frozen=True)
class Accelerator:
    """One accelerator: datasheet peak FLOP/s per dtype, memory and its bandwidth, and what prices a kernel."""

    name: str
    peak_flops: dict  # dtype name -> FLOP/s ("bf16", "fp16", "fp32"): the datasheet's, dense
    memory_bytes: float
    memory_bandwidth: float  # bytes/s to its own memory (memory-bound work)
    sms: int = 0  # streaming multiprocessors: GEMMs run in waves of tiles over them (0: no tiles)
    matmul_efficiency: float = 1.0  # the fastest GEMM's fraction of peak (a microbenchmark's; 1 for measured rates)
    op_overhead: float = 0.0  # host seconds per operation (dispatch, launch)
    asynchronous: bool = True  # the host runs ahead of the device (a GPU); False: it runs each op (a CPU)
    gemm_rates: dict = field(default_factory=dict)  # measured: dtype -> ((FLOPs of one GEMM, FLOP/s), ...), by size
    source: str = ""
    published: GpuMeasurements | None = field(default=None, compare=False)  # its kernels, measured (`published`)

    def flops_per_s(self, dtype: str = "bf16") -> float:
        key = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}.get(
            dtype, dtype
        )
        if key not in self.peak_flops:
            raise ValueError(f"{self.name} has no peak for dtype {dtype!r}; known: {sorted(self.peak_flops)}.")
        return self.peak_flops[key]


@dataclass(frozen=True)
class Cluster:
    """Nodes of `gpus_per_node` accelerators: `intra` links inside a node, `inter` (one NIC per GPU) between."""

    name: str
    gpu: Accelerator
    gpus_per_node: int
    intra: Link
    inter: Link
    call_latency: float = 0.0  # seconds every collective call pays once (NCCL's base latency)
    source: str = ""
    overlap: float = 1.0  # fraction of a collective's time that can hide behind compute: 1 where the
    #                                 links and copy engines are their own hardware (GPUs); measured on a CPU,
    #                                 whose cores do the copies (toolkit.sim.calibrate)
    beside_compute: float = 1.0  # how many times longer an asynchronous collective takes in flight beside compute
    #                                 (timeline rule 5): 1 on every preset; a what-if (measured on a CPU, not charged)
    latency_holds_link: bool = True  # a collective holds its links for its latency too (NCCL runs a
    #                                 communicator's collectives one after the other); False where latency
    #                                 is delay in flight and the next message may go meanwhile (the emulator)
    op_links: dict = field(default_factory=dict, compare=False)  # op -> Link measured for it inside a node
    collective_lanes: int = 1  # collectives a link runs at once (timeline rule 2): 1 under NCCL; gloo's threads
    underlay: Cluster | None = field(default=None, compare=False)  # an emulated link's real links, beneath it
    published: NetworkMeasurements | None = field(default=None, compare=False)  # its collectives, measured
    notes: dict = field(default_factory=dict, compare=False)  # e.g. calibration details

    def node_of(self, rank: int) -> int:
        return int(rank) // self.gpus_per_node

    def check_world(self, world_size: int) -> None:
        """A world is part of one node, or whole nodes: world_size < gpus_per_node, or a multiple of it."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}.")
        if world_size > self.gpus_per_node and world_size % self.gpus_per_node:
            fits = [self.gpus_per_node * k for k in range(1, 4)]
            raise ValueError(
                f"world_size={world_size} does not fill whole nodes of {self.gpus_per_node} GPUs on "
                f"{self.name!r}: use a multiple of {self.gpus_per_node} (e.g. {fits}), or a cluster with "
                f"smaller nodes: toolkit.sim.cluster_of({self.name!r}, gpus_per_node=...)."
            )

    def with_changes(self, **changes) -> Cluster:
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        return (
            f"{self.name}: {self.gpus_per_node} x {self.gpu.name} per node; inside a node "
            f"{self.intra.describe()}, between nodes {self.inter.describe()} per GPU"
        )


# --- presets -------------------------------------------------------------------------------------------
_A100 = dict(
    peak_flops={"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    sms=108,
    op_overhead=5e-6,
    matmul_efficiency=measured.A100_GEMM.value,
    published=measured.A100,
)
_H100 = dict(
    peak_flops={"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    sms=132,
    op_overhead=5e-6,
    matmul_efficiency=measured.H100_GEMM.value,
    published=measured.H100,
)
_SOURCES = "; kernels: toolkit.sim.published"
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
        + "; collectives: toolkit.sim.published",
        published=measured.DGX_A100,
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
        + "; collectives: toolkit.sim.published",
        published=measured.DGX_H100,
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


# --- resolving what a user passes -----------------------------------------------------------------------
_CLUSTER_FIELDS = ("name", "gpu", "gpus_per_node", "intra", "inter")
_GPU_FIELDS = ("name", "peak_flops", "memory_bytes", "memory_bandwidth")
_EXAMPLE = (
    "dict(name='my-cluster', gpu='a100-80gb', gpus_per_node=8, intra=('300 GB/s', '3.4 us'), "
    "inter=('200 Gb/s', '9.6 us'), call_latency='8.4 us')"
)


def _link(value, what: str) -> Link:
    if isinstance(value, Link):
        return Link(
            parse_bandwidth(value.bandwidth, f"{what} bandwidth"), parse_latency(value.latency, f"{what} latency")
        )
    if isinstance(value, dict) and set(value) == {"bandwidth", "latency"}:
        value = (value["bandwidth"], value["latency"])
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return Link(parse_bandwidth(value[0], f"{what} bandwidth"), parse_latency(value[1], f"{what} latency"))
    raise ValueError(
        f"cluster field {what!r}={value!r}: give a link as (bandwidth, latency), e.g. "
        f"('200 Gb/s', '9.6 us'), or dict(bandwidth=..., latency=...)."
    )


def accelerator(spec) -> Accelerator:
    """An Accelerator from a preset name (see `GPUS`), an Accelerator, or a dict with its fields."""
    if isinstance(spec, Accelerator):
        return spec
    if isinstance(spec, str):
        if spec.lower() not in GPUS:
            raise ValueError(
                f"unknown accelerator {spec!r}; known: {sorted(GPUS)}, or a dict with the fields {list(_GPU_FIELDS)}."
            )
        return GPUS[spec.lower()]
    if isinstance(spec, dict):
        missing = [f for f in _GPU_FIELDS if f not in spec]
        if missing:
            raise ValueError(
                f"accelerator {spec.get('name', '(unnamed)')!r} is missing {missing}; an accelerator "
                f"needs {list(_GPU_FIELDS)} (sms, matmul_efficiency, op_overhead, "
                f"asynchronous, source optional)."
            )
        unknown = set(spec) - {f.name for f in dataclasses.fields(Accelerator)}
        if unknown:
            raise ValueError(
                f"accelerator has unknown fields {sorted(unknown)}; valid: "
                f"{[f.name for f in dataclasses.fields(Accelerator)]}."
            )
        gpu = Accelerator(**spec)
        check_mfu(gpu.matmul_efficiency, "matmul_efficiency")
        return gpu
    raise ValueError(f"an accelerator is a preset name {sorted(GPUS)}, an Accelerator or a dict, not {spec!r}.")


def cluster_of(spec, **changes) -> Cluster:
    """A Cluster from a preset name, a Cluster, or a dict (a user-defined cluster); `changes` override fields.

    "this-machine" is calibrated by measurement: use `toolkit.sim.calibrate.this_machine(world_size)`
    (simulate(..., cluster="this-machine") does it for you).
    """
    if isinstance(spec, str):
        name = spec.lower()
        if name == THIS_MACHINE:
            raise ValueError(
                "'this-machine' is measured, not listed: call toolkit.sim.calibrate.this_machine(world_size) for it."
            )
        if name not in CLUSTERS:
            raise ValueError(
                f"unknown cluster preset {spec!r}; known presets: {sorted(presets())}, or a "
                f"user-defined cluster as a dict, e.g. {_EXAMPLE}."
            )
        found = CLUSTERS[name]
    elif isinstance(spec, Cluster):
        found = spec
    elif isinstance(spec, dict):
        missing = [f for f in _CLUSTER_FIELDS if f not in spec]
        if missing:
            raise ValueError(
                f"cluster {spec.get('name', '(unnamed)')!r} is missing {missing}; a cluster needs "
                f"{list(_CLUSTER_FIELDS)} (call_latency, source optional), e.g. {_EXAMPLE}."
            )
        unknown = set(spec) - set(_CLUSTER_FIELDS) - {"call_latency", "source"}
        if unknown:
            raise ValueError(
                f"cluster has unknown fields {sorted(unknown)}; valid: "
                f"{list(_CLUSTER_FIELDS) + ['call_latency', 'source']}."
            )
        found = Cluster(
            str(spec["name"]),
            accelerator(spec["gpu"]),
            spec["gpus_per_node"],
            _link(spec["intra"], "intra"),
            _link(spec["inter"], "inter"),
            parse_latency(spec["call_latency"], "call_latency") if spec.get("call_latency") else 0.0,
            spec.get("source", "user-defined"),
        )
    else:
        raise ValueError(
            f"cluster={spec!r}: give a preset name {sorted(presets())}, a Cluster, or a dict such as {_EXAMPLE}."
        )
    if changes:
        unknown = set(changes) - {f.name for f in dataclasses.fields(Cluster)}
        if unknown:
            raise ValueError(
                f"cluster_of(...) got unknown fields {sorted(unknown)}; valid: "
                f"{[f.name for f in dataclasses.fields(Cluster)]}."
            )
        if "gpu" in changes:
            changes["gpu"] = accelerator(changes["gpu"])
        for key in ("intra", "inter"):
            if key in changes:
                changes[key] = _link(changes[key], key)
        found = found.with_changes(**changes)
    gpn = found.gpus_per_node
    if isinstance(gpn, bool) or not isinstance(gpn, int) or gpn < 1:
        raise ValueError(f"cluster {found.name!r}: gpus_per_node must be a positive integer, got {gpn!r}.")
    if isinstance(found.overlap, bool) or not isinstance(found.overlap, (int, float)) or not 0 <= found.overlap <= 1:
        raise ValueError(
            f"cluster {found.name!r}: overlap={found.overlap!r} is the fraction of a collective that can "
            f"hide behind compute, in [0, 1] (1: links beside the compute, as on GPUs)."
        )
    beside = found.beside_compute
    if isinstance(beside, bool) or not isinstance(beside, (int, float)) or not 1 <= beside < float("inf"):
        raise ValueError(
            f"cluster {found.name!r}: beside_compute={beside!r} is how many times longer a collective "
            f"takes in flight beside compute, a finite number >= 1 (1: links of their own, as on GPUs)."
        )
    return found


def check_mfu(mfu, name: str = "mfu") -> float:
    """An achievable fraction of peak lies in (0, 1]."""
    if isinstance(mfu, bool) or not isinstance(mfu, (int, float)) or not 0 < mfu <= 1:
        raise ValueError(
            f"{name}={mfu!r}: the achievable fraction of peak must be in (0, 1] (e.g. 0.5 for half "
            f"of the accelerator's peak FLOP/s)."
        )
    return float(mfu)
