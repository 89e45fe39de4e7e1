"""How long one operation takes on an accelerator: a roofline per kernel, GEMMs in waves of tiles.

A recorded step holds every aten operation it ran (`toolkit.sim.program.Kernel`). Each is priced
apart, from the accelerator's datasheet and the kernel's own shape, with nothing fitted to a step:

1. A GEMM (batch x (m x k) @ (k x n)) runs as cuBLAS runs it: its output is cut into tiles, one
   thread block per tile, and the blocks run in waves of one per SM (NVIDIA, "Matrix Multiplication
   Background User's Guide", sections 2.3 and 3: tile quantization, a partial tile costs a whole one;
   wave quantization, a partial wave costs a whole one). Each tile computes at the accelerator's
   best measured GEMM rate per SM (`matmul_efficiency` x peak / SMs: the maximum achievable matmul
   FLOP/s, a microbenchmark's, not a training run's), or slower when its operands cannot stream from
   L2 fast enough: a Tm x Tn tile does 2·Tm·Tn FLOPs per (Tm + Tn) operands it reads, so small tiles are
   bound by L2 bandwidth. Of the tiles cuBLAS uses (`TILES`), the fastest for the shape is taken.
   The whole GEMM is also never faster than reading and writing its matrices from memory.
2. A fused attention (FlashAttention's kernels) is two or five GEMMs per block of scores (forward,
   backward) at the GEMM rate, in waves of one block of 128 queries per SM, plus the softmax on every
   score at the rate of the SMs' ordinary FP32 units, not the tensor cores (`SOFTMAX_OPS`, counted from
   the algorithm: FlashAttention-2, Dao 2023, section 3, names this cost). A causal mask skips the
   blocks above the diagonal.
3. Anything else (layer norms, GELU, adds, the optimizer's elementwise update) moves its bytes at the
   memory's bandwidth, or computes its FLOPs at the FP32 rate where torch counts any, whichever is slower.
4. The host: every operation costs `op_overhead` seconds of host work (the framework's dispatch and the
   kernel launch). On a GPU the host runs ahead of the device, so a run of operations takes the longer
   of the two totals (device work, host work): launches only show where kernels are shorter than them.
   On a CPU the host runs each operation itself: the two add up.
"""
from __future__ import annotations

import math

from .program import Compute, Kernel

TILES = ((256, 128), (128, 256), (128, 128), (256, 64), (64, 256), (128, 64), (64, 128), (64, 64))  # cuBLAS's
#        tensor-core tiles, most to least efficient (the User's Guide above, section 2.3)
ATTENTION_BLOCK = 128    # queries per thread block in FlashAttention-2's kernels
SOFTMAX_OPS = {False: 8, True: 9}  # FP32 operations per score, forward / backward: scale, max, subtract, exp
#                                    (its special-function unit does a quarter of the FP32 rate: 4), sum;
#                                    backward: rescale, subtract, exp (4), dP - D, times P, scale
ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}


def gemm_seconds(gpu, batch: int, m: int, n: int, k: int, dtype: str) -> float:
    """Device seconds of batch x (m x k) @ (k x n), compute-bound part only (tiles in waves on the SMs)."""
    flops = 2.0 * batch * m * n * k
    if not gpu.sms:  # no SMs to fill (a CPU): the rate measured at the nearest sizes
        return flops / measured_rate(gpu, flops / batch, dtype)
    rate = gpu.flops_per_s(dtype) * gpu.matmul_efficiency
    element = ELEMENT_BYTES.get(dtype, 2)
    best = math.inf
    for tm, tn in TILES:
        per_sm = rate / gpu.sms
        if gpu.l2_bandwidth:
            per_sm = min(per_sm, gpu.l2_bandwidth / gpu.sms * 2 * tm * tn / ((tm + tn) * element))
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        best = min(best, math.ceil(tiles / gpu.sms) * 2.0 * tm * tn * k / per_sm)
    return best


def measured_rate(gpu, flops: float, dtype: str) -> float:
    """FLOP/s of one GEMM of `flops` where the rate was measured by size (log-linear between the sizes measured,
    the nearest one's beyond them); the peak x matmul_efficiency where it was not."""
    points = sorted(gpu.gemm_rates.get(dtype, ()))
    if not points:
        return gpu.flops_per_s(dtype) * gpu.matmul_efficiency
    if flops <= points[0][0]:
        return points[0][1]
    for (f0, r0), (f1, r1) in zip(points, points[1:]):
        if flops <= f1:
            w = math.log(flops / f0) / math.log(f1 / f0)
            return r0 * (r1 / r0) ** w
    return points[-1][1]


def gemm_efficiency(gpu, batch: int, m: int, n: int, k: int, dtype: str = "bf16") -> float:
    """The fraction of the datasheet peak this GEMM shape reaches (tiles, waves, the best measured GEMM rate)."""
    return 2.0 * batch * m * n * k / gemm_seconds(gpu, batch, m, n, k, dtype) / gpu.flops_per_s(dtype)


def attention_seconds(gpu, kernel: Kernel) -> float:
    """Device seconds of a fused attention kernel, compute part: its GEMMs in waves, then the softmax."""
    batch, heads, queries, keys, _, causal, backward = kernel.shape
    blocks = math.ceil(queries / ATTENTION_BLOCK)
    done = (blocks + 1) / (2 * blocks) if causal else 1.0  # blocks on and below the diagonal
    rate = gpu.flops_per_s(kernel.dtype) * gpu.matmul_efficiency
    if gpu.sms:
        ctas = batch * heads * blocks
        rate *= ctas / (math.ceil(ctas / gpu.sms) * gpu.sms)
    softmax = SOFTMAX_OPS[backward] * batch * heads * queries * keys / gpu.flops_per_s("fp32")
    return (kernel.flops / rate + softmax) * done


def device_seconds(gpu, kernel: Kernel) -> float:
    """Seconds one kernel keeps the device busy: the slower of its compute and its memory traffic."""
    memory = kernel.bytes / gpu.memory_bandwidth
    if kernel.kind == "gemm":
        return max(gemm_seconds(gpu, *kernel.shape, kernel.dtype), memory)
    if kernel.kind == "attention":
        return max(attention_seconds(gpu, kernel), memory)
    compute = kernel.flops / gpu.flops_per_s("fp32") if kernel.flops else 0.0
    return max(compute, memory)


def segment_seconds(segment: Compute, gpu, cache: dict | None = None) -> tuple[float, float]:
    """(seconds, device seconds) of a compute segment priced kernel by kernel (rule 4 for the host)."""
    device = 0.0
    for kernel, count in segment.kernels:
        if cache is None:
            device += count * device_seconds(gpu, kernel)
            continue
        if kernel not in cache:
            cache[kernel] = device_seconds(gpu, kernel)
        device += count * cache[kernel]
    host = segment.ops * gpu.op_overhead
    return (max(device, host) if gpu.asynchronous else device + host), device
