"""The records a simulated step's hardware is: an accelerator, and a cluster of them joined by two levels of links.

A cluster is two levels of links, as a DGX-style machine room is: `gpus_per_node` accelerators joined
by NVLink/NVSwitch inside a node (`intra`), and one network card per accelerator between nodes
(`inter`). Every bandwidth is per accelerator and per direction; every latency is what one step of a
ring pays on that kind of link (alpha), plus `call_latency` once per collective call. The presets are in
`hardware_presets.py`; `hardware.py` resolves what a user names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..comm.emulate import Link
from .published import GpuMeasurements, NetworkMeasurements


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
    op_links: dict = field(default_factory=dict, compare=False)  # op, or (op, group size), -> Link measured for
    #                                 it inside a node (`collective_time.measured_link`)
    collective_lanes: int = 1  # collectives a link runs at once (timeline rule 2): 1 under NCCL; gloo's threads
    links_share: bool = False  # collectives on one link share its rate (`link_sharing`, as NCCL's communicators
    #                                 on their own streams do) rather than take turns: True on the GPU presets;
    #                                 False where one thread runs them in turn (gloo, this machine's calibration)
    underlay: Cluster | None = field(default=None, compare=False)  # an emulated link's real links, beneath it
    bookings: float = 0.0  # an emulated link's: host seconds its bookkeeping adds to an all-to-all's issue, for
    #                                 world - 1 peers (the job's store, measured: `calibrate_links.emulator_bookings`)
    marks: float = 0.0  # an emulated link's: host seconds a ring collective's or a barrier's issue marks cost (its
    #                                 own at issue, its peers' read after the call: `calibrate_links.emulator_marks`)
    late_peers: tuple = ()  # an emulated link's: ((compute seconds a rank ran since its last call, seconds after
    #                                 its issue the group's last rank issued), ...): `calibrate_late.late_peers`
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
