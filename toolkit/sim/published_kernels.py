"""Published measurements of the GPUs' kernels, each with its source: GEMMs by shape, HBM bandwidth, attention.

`A100` and `H100` (`published.GpuMeasurements`) are what the GPU presets' kernels are priced from
(`kernel_time`); the tables beside them (`*_GEMM_TABLE`, `*_FA2`, `*_STANDARD`) are what tests/test_sim_published.py
holds the model to. None was measured on a training run.
"""

from __future__ import annotations

from .published import GpuMeasurements, Measured

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
# the fastest GEMM a search of shapes found: the tiled model, held to one large shape, prices a long k above it (H100:
# 2048x2048x13312, MAMF's own best, at 847 TFLOP/s; a weight gradient's k = tokens, 16384, at 853-876), which no search
# of the hardware measured. A100: MAMF (mean of 100 iterations after a 30 s warm-up, L2 flushed, random data); its
# large shapes' rate is itself a sustained one (cuBLASLt after 10,000 warm-up iterations). H100: the rate the fastest
# shape sustains once the GPU holds its 700 W power limit (MSMF), where MAMF's short windows after a warm-up read part
# of the boost clock: a GEMM that fills every SM at a long k draws the limit and its clock settles below boost, while a
# shorter one runs at boost under the limit (2816x1536: 727 TFLOP/s at k = 20480, 749 at 6144, 722 at 4096 at 1980 MHz).
_MSMF = (
    "S. Bekman, Machine Learning Engineering, compute/accelerator/benchmarks/README.md, 'How MAMF and MSMF are "
    "defined' and 'What was measured: alone vs all-8 concurrent' (mamf-finder.py benchmark version 4, torch "
    "2.14.0+cu130): on an H200 (the H100 SXM's GH100 die, 132 SMs, 1980 MHz, 700 W; HBM3e for HBM3) the best shape "
    "sustains 744.8 TFLOP/s alone (5 runs), 743.4 while its 7 siblings compute, 755.5 the median of all 8 busy "
    "(1850-1938 MHz), the node's slowest GPU 745, where its burst (MAMF) is 848"
)
A100_GEMM_CEILING = Measured(
    271.2 / 312, 271.2 / 312, 271.2 / 312, "NVIDIA A100 SXM: 271.2 (1024x10240x5120, " + _MAMF + ")"
)
H100_GEMM_CEILING = Measured(
    745 / 989,
    738.6 / 989,
    794.5 / 989,
    "sustained at the power limit: 745, the slowest GPU of an 8-GPU node all computing (a synchronous job runs at it; "
    + _MSMF
    + "); MAMF's H100 SXM entries 738.6 (CUDA 12.1, 68fdb6c, 2024-08) to 794.5 (2048x2048x13312, torch 2.7 + CUDA "
    "12.6, " + _MAMF + ")",
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
