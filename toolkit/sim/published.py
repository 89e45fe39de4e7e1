"""Published measurements of the hardware, each with its source: what the GPU presets are priced from.

Nothing here was measured on, or chosen to match, a training run the simulator is judged against (Megatron-LM's
Table 1, the FSDP paper, llm-foundry's tables, torchtitan's): these are kernels and collectives timed alone, by
their vendors or by third parties, on the GPUs and networks of the presets. `kernel_time` and `collective_time`
read them; `docs/differences.md` ("Pricing from published measurements") lists them with their uses.

Every number is a `Measured`: the value the model uses, and the two ends of what the sources say (`worst`, `best`:
the slower and the faster end for a step). `at(obj, "worst")` swaps every Measured inside a preset for one of its
ends, which is how a prediction's band is priced (`cost.StepCost.band`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GB = 1e9


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


# --- GEMMs: cuBLAS(Lt) at a large shape, the best shape of a search (MAMF), CUTLASS's pipelines ----------------
_MAMF = (
    "S. Bekman, Machine Learning Engineering, compute/accelerator/README.md, 'Maximum Achievable Matmul FLOPS "
    "comparison table' (stas00/ml-engineering 744d01e): the best shape of a search, mean of 100 iterations"
)
_AZURE = "Azure/AI-benchmarking-guide, Azure_Results/ND_{}_results.md"
A100_GEMM = Measured(
    256.5 / 312,
    253.7 / 312,
    271.2 / 312,
    _AZURE.format("A100_v4") + ": cuBLASLt FP16 16384^3 256.5 TFLOP/s (8192^3: 253.7; 10,000 "
    "warm-up iterations, random data, CUDA 12.5); best: MAMF 271.2 (1024x10240x5120, " + _MAMF + ")",
)
H100_GEMM = Measured(
    783.3 / 989,
    738.6 / 989,
    794.5 / 989,
    "openxla/xla, xla/service/gpu/model/matmul_interpolator_data.h (kDefaultMatmulPTable, sm_90, "
    "bf16xbf16->bf16): 4096^3 783.3 TFLOP/s; best: MAMF 794.5 (2048x2048x13312, torch 2.7 + CUDA "
    "12.6, " + _MAMF + "); worst: the same table's H100 entry with CUDA 12.1, 738.6 (2816x15616x4096, "
    "stas00/ml-engineering 68fdb6c, 2024-08)",
)
# the fastest GEMM a search of shapes found (MAMF: mean of 100 iterations after a 30 s warm-up, L2 flushed, random
# data): the tiled model, held to one large shape, prices a long k above it (H100: 2048x2048x13312, MAMF's own best,
# at 847 TFLOP/s; a weight gradient's k = tokens, 16384, at 853-876), which no search of the hardware measured
A100_GEMM_CEILING = Measured(
    271.2 / 312, 271.2 / 312, 271.2 / 312, "NVIDIA A100 SXM: 271.2 (1024x10240x5120, " + _MAMF + ")"
)
H100_GEMM_CEILING = Measured(
    794.5 / 989,
    738.6 / 989,
    794.5 / 989,
    "NVIDIA H100 SXM: 794.5 (2048x2048x13312, torch 2.7 + CUDA 12.6, " + _MAMF + "); the same table's "
    "earlier H100 entries 738.6 (CUDA 12.1, 68fdb6c, 2024-08) to 792.1 (CUDA 12.1, 6144x17920x2816, 8deeddd)",
)
CUTLASS_SM80_STAGES = 3  # cutlass/gemm/device/default_gemm_configuration.h, Sm80 tensor op: 128x256x64 tiles, kStages 3
CUTLASS_SM90_STAGES = 4  # CUTLASS's sm90 collective builder, StageCountAuto: 227 KB of shared memory over 48 KB per
#                          stage of a 128x256x64 bf16 tile, less the epilogue's share

# validation tables (tests/test_sim_published.py): (batch, m, n, k) -> TFLOP/s, the sources above
A100_GEMM_TABLE = {
    (1, 1024, 1024, 1024): 119.4,
    (1, 2048, 2048, 2048): 221.8,
    (1, 4096, 4096, 4096): 228.0,
    (1, 8192, 8192, 8192): 253.7,
    (1, 16384, 16384, 16384): 256.5,
    (1, 1024, 2145, 1024): 132.8,
    (1, 6144, 12288, 12288): 250.8,
    (1, 802816, 192, 768): 157.8,
}
H100_GEMM_TABLE = {
    (1, 4096, 4096, 4096): 783.3,
    (2, 4096, 2048, 4096): 783.2,
    (2, 4096, 4096, 2048): 763.0,
    (4, 2048, 2048, 2048): 725.7,
    (4, 1024, 2048, 2048): 712.7,
    (2, 4096, 512, 4096): 729.7,
    (4, 4096, 1024, 1024): 673.8,
    (1, 2048, 2048, 2048): 632.0,
    (1, 4096, 2048, 512): 447.0,
    (2, 1024, 2048, 1024): 493.4,
    (1, 1024, 1024, 2048): 350.0,
    (1, 4096, 4096, 256): 392.2,
}

# --- memory-bound kernels: STREAM-like kernels on the GPU -------------------------------------------------------
A100_HBM = Measured(
    1.655 / 2.039,
    1.61 / 2.039,
    1.70 / 2.039,
    _AZURE.format("A100_v4") + ", HBM bandwidth: Copy 1.61, Mul "
    "1.61, Add 1.70, Triad 1.70 TB/s of the datasheet's 2.039 (value: their mean)",
)
H100_HBM = Measured(
    2.935 / 3.35,
    2.90 / 3.35,
    2.97 / 3.35,
    _AZURE.format("H100_v5") + ", HBM bandwidth: Copy 2.90, Mul "
    "2.90, Add 2.97, Triad 2.97 TB/s of the datasheet's 3.35 (value: their mean)",
)

# --- attention: FlashAttention-2's own benchmark (fwd + bwd, FLOPs counted as 4 b s^2 h d x 3.5, causal halved) ---
_FA2 = (
    "Dao 2023, FlashAttention-2, Dao-AILab/flash-attention assets/flash2_{}_fwd_bwd_benchmark.png (4f285b3) from "
    "benchmarks/benchmark_flash_attention.py: 16k tokens a batch, hidden 2048, fp16, dropout 0"
)
SEQ = (512, 1024, 2048, 4096, 8192, 16384)
A100_FA2 = {
    (False, 64): (132, 153, 162, 171, 175, 176),
    (False, 128): (151, 173, 187, 196, 201, 203),
    (True, 64): (88, 119, 140, 156, 165, 171),
    (True, 128): (99, 133, 155, 173, 182, 189),
}
#            (False, 128) at 512: the label is under the figure's legend; 151 is read from the bar's top
H100_FA2 = {
    (False, 64): (215, 254, 274, 288, 294, 296),
    (False, 128): (248, 294, 320, 326, 335, 338),
    (True, 64): (141, 192, 232, 257, 273, 284),
    (True, 128): (163, 221, 265, 294, 308, 328),
}
# the same figures' "Pytorch" bars (standard attention: baddbmm, softmax, dropout, bmm), sequence 512 to 8k:
# the unfused path priced operation by operation is held to them (tests/test_sim_published.py)
A100_STANDARD = {
    (False, 64): (36, 40, 43, 45, 46),
    (False, 128): (53, 67, 76, 79, 86),
    (True, 64): (15, 16, 17, 18, 18),
    (True, 128): (23, 28, 32, 32, 34),
}
H100_STANDARD = {
    (False, 64): (62, 72, 81, 86, 87),
    (False, 128): (93, 120, 145, 160, 167),
    (True, 64): (26, 29, 31, 32, 32),
    (True, 128): (40, 50, 57, 61, 63),
}
A100_ATTENTION_SCALE = Measured(
    1.0,
    1.0,
    179.5 / 175,
    _AZURE.format("A100_v4") + ": FlashAttention 2.0, head dim 64, "
    "batch 2, sequence 8192: 179.5 TFLOP/s against the figure's 175",
)
H100_ATTENTION_SCALE = Measured(
    1.0,
    327.9 / 335,
    1.0,
    _AZURE.format("H100_v5") + ": FlashAttention 2.0, head dim "
    "128, batch 2, sequence 8192: 327.9 TFLOP/s against the figure's 335",
)


def _table(seq_rates: dict) -> dict:
    return {key: tuple(zip(SEQ, rates)) for key, rates in seq_rates.items()}


A100 = GpuMeasurements(
    (1, 16384, 16384, 16384),
    A100_GEMM,
    A100_GEMM_CEILING,
    CUTLASS_SM80_STAGES,
    A100_HBM,
    _table(A100_FA2),
    A100_ATTENTION_SCALE,
)
H100 = GpuMeasurements(
    (1, 4096, 4096, 4096),
    H100_GEMM,
    H100_GEMM_CEILING,
    CUTLASS_SM90_STAGES,
    H100_HBM,
    _table(H100_FA2),
    H100_ATTENTION_SCALE,
)
FA2_SOURCE = {"a100": _FA2.format("a100"), "h100": _FA2.format("h100")}

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
