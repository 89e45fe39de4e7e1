"""Published measurements of the clusters' collectives, each with its source: nccl-tests inside a node, the network
cards' rate in NCCL, and how much compute slows beside NCCL's kernels.

`DGX_A100` and `DGX_H100` (`published.NetworkMeasurements`) are what the cluster presets' collectives are priced
from (`collective_time`, `timeline`). None was measured on a training run.
"""

from __future__ import annotations

from .published import Measured, NetworkMeasurements

GB = 1e9

# --- collectives: nccl-tests bus bandwidth by message size, network cards, compute beside NCCL ------------------
_KIB = [2**i for i in range(10, 34)]  # 1 KiB .. 8 GiB, as the tables label them (1K, 2K, ..., 65K, 132K, ...)
A100_ALL_REDUCE = tuple(
    zip(
        _KIB,
        (
            0.04,
            0.08,
            0.17,
            0.33,
            0.67,
            1.37,
            2.70,
            5.15,
            10.11,
            19.24,
            36.22,
            53.54,
            71.43,
            89.99,
            109.22,
            132.77,
            166.63,
            174.18,
            213.87,
            221.58,
            228.10,
            230.22,
            230.48,
            231.58,
        ),
    )
)
H100_ALL_REDUCE = tuple(
    zip(
        _KIB,
        (
            0.07,
            0.14,
            0.27,
            0.53,
            0.95,
            1.71,
            2.72,
            5.40,
            10.86,
            21.35,
            43.70,
            81.93,
            128.73,
            172.13,
            234.45,
            295.53,
            361.78,
            400.61,
            423.38,
            438.46,
            466.35,
            472.36,
            475.54,
            478.87,
        ),
    )
)
ALL_REDUCE_SOURCE = (
    "Azure/AI-benchmarking-guide, Azure_Results/ND_A100_v4_results.md and ND_H100_v5_results.md, "
    "'NCCL Bandwidth': nccl-tests all_reduce, 8 GPUs, in place, NCCL 2.18.5 (A100: 231.6 GB/s at 8 "
    "GiB; S. Bekman's DGX A100 run, network/README.md, 229.0 at 1 GiB, 234.9 at 16 GiB; H100: NVLink "
    "SHARP, 478.9)"
)
A100_P2P = Measured(
    274 / 300,
    271 / 300,
    277 / 300,
    "S. Bekman, network/README.md: p2pBandwidthLatencyTest on 8x A100, "
    "unidirectional P2P writes 271-277 GB/s of NVLink 3's 300",
)
H100_P2P = Measured(
    376 / 450,
    363 / 450,
    394 / 450,
    "S. Bekman, network/README.md: p2pBandwidthLatencyTest on 8x H100, "
    "unidirectional P2P writes 363-394 GB/s (376 typical) of NVLink 4's 450",
)
A100_RING = Measured(1.0, 1.0, 1.0, "A100 has no NVLink SHARP: every collective rings (the all_reduce curve)")
H100_RING = Measured(
    367.2 / 480.0,
    367.2 / 480.0,
    367.2 / 480.0,
    "S. Bekman, network/README.md ('SHARP'): 8x H200 (NVLink 4, as H100), nccl-tests all_reduce at "
    "16 GiB: 480.0 GB/s with NVLink SHARP, 367.2 with NCCL_NVLS_ENABLE=0 (the ring every other "
    "collective runs)",
)
HDR_NIC = Measured(
    24 / 25,
    24 / 25,
    24 / 25,
    "S. Jeaugey (NCCL), NVIDIA/nccl#412: 24 GB/s inter-node for 200 Gb/s "
    "HDR; nccl-tests#119: 4 HDR cards for 8 A100s peak at 96 GB/s bus bandwidth (24 per card)",
)
NDR_NIC = Measured(
    47 / 50,
    46 / 50,
    48 / 50,
    "AddyLaddy (NCCL team), NVIDIA/nccl-tests#290: 'For NDR @ 400Gbps you should see 46-48GB/s per NIC'",
)
OVERLAP_SLOWDOWN = Measured(
    0.189,
    0.40,
    0.0,
    "Lee et al. 2025, 'Characterizing Compute-Communication Overlap in "
    "GPU-Accelerated Distributed Deep Learning' (arXiv 2507.03114), A100/H100/MI250/MI210: "
    "compute overlapped with communication runs 18.9% slower on average, 40.0% at most "
    "(best: none, the ideal they compare against)",
)
DGX_A100 = NetworkMeasurements(A100_ALL_REDUCE, 300 * GB, A100_RING, A100_P2P, HDR_NIC, OVERLAP_SLOWDOWN)
DGX_H100 = NetworkMeasurements(H100_ALL_REDUCE, 450 * GB, H100_RING, H100_P2P, NDR_NIC, OVERLAP_SLOWDOWN)
