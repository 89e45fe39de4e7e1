"""How long one operation takes on an accelerator: GEMMs in waves of tiles, attention and memory-bound kernels at
their published rates, and the host's launches.

A recorded step holds every aten operation it ran (`toolkit.sim.program.Kernel`). Each is priced apart, from the
accelerator's datasheet, the published measurements of its kernels (`toolkit.sim.published`) and the kernel's own
shape; nothing is fitted to a training run:

1. A GEMM (batch x (m x k) @ (k x n)) runs as cuBLAS runs it: its output is cut into tiles, one thread block per
   tile, and the blocks run in waves of one per SM (NVIDIA, "Matrix Multiplication Background User's Guide",
   section 3: tile quantization, a partial tile costs a whole one; wave quantization, a partial wave costs a whole
   one). Of cuBLAS's large tensor-core tiles (`TILES`), the fastest for the shape is taken. A tile runs k-blocks
   of `TILE_K` through a pipeline of `gemm_stages` (CUTLASS's: all but one k-block, as many as there are, are
   loaded before the first is computed), then writes its outputs to memory (the epilogue, at the SM's share of the
   HBM bandwidth, not overlapped: one such tile fills an SM's shared memory). The SMs'
   rate per k-block is the one that makes this reproduce a published cuBLAS measurement at a large shape
   (`published.GpuMeasurements.gemm_rate`): short k (few k-blocks for the same fill and epilogue) and small grids
   are slower, from the architecture alone. The whole GEMM is never faster than moving its matrices, nor than
   the fastest GEMM a brute-force search of shapes measured on the GPU (`gemm_ceiling`, MAMF): held to one large
   shape, the tiles alone would price a long k (a weight gradient's k is the batch's tokens) above any
   measurement of the hardware.
2. A fused attention (FlashAttention) runs at FlashAttention-2's own published rate for its head dimension,
   sequence length and mask (forward + backward; interpolated, and scaled by how well its blocks of 128 queries
   fill the SMs against the benchmark's). Unfused attention (the papers' code) is its GEMMs and memory-bound
   kernels, each priced as such.
3. Anything else (layer norms, GELU, adds, softmax, the optimizer's update) moves its bytes at the HBM bandwidth
   a streaming kernel reaches (published STREAM-like measurements), or computes its FLOPs at the FP32 rate,
   whichever is slower.
4. The host: every operation it dispatches costs `op_overhead` seconds of host work (dispatch and launch), a view's
   too (the calibration divides by every operation dispatched, `calibrate_compute.count_ops`). On a GPU the host
   runs ahead of the device, so a run of operations takes the longer of the two totals, and a run of views alone
   (between two collectives: nothing for the device to do) takes none of its time (`cost.compute_time`); on a CPU
   the two add up.

Clocks: a GEMM that fills every SM at a long k draws the GPU's power limit, and its clock settles below boost; a
shorter one runs at boost under the limit. The A100's rate was measured so (cuBLASLt after 10,000 warm-up iterations
on random data, 16384^3); the H100's shapes are priced from a table of shorter runs and held to the rate the fastest
shape sustains at the 700 W limit (MSMF: `gemm_ceiling`), 6% under the fastest burst an H100 was measured at.
An accelerator without published measurements (a user-defined one) is priced at its datasheet:
GEMMs at `matmul_efficiency` x peak per SM, attention at that GEMM rate, memory at its full bandwidth.
"""

from __future__ import annotations

import math

from .program import Compute, Kernel

TILES = ((256, 128), (128, 256), (128, 128))  # cuBLAS's large tensor-core tiles (the User's Guide, section 2.3)
TILE_K = 64  # the k-depth of a tile's k-block (CUTLASS's Sm80 default, 128 x 256 x 64; Sm90's too)
DEFAULT_STAGES = 3  # where no measurement says otherwise (CUTLASS's Sm80 default)
ATTENTION_BLOCK = 128  # queries per thread block in FlashAttention-2's kernels
FA2_HIDDEN = 2048  # FlashAttention-2's benchmark: heads = 2048 / head dim, 16k tokens a batch
ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}


def hbm_bandwidth(gpu) -> float:
    """Bytes/s a streaming kernel reaches: the published fraction of the datasheet's, or the datasheet's."""
    measured = gpu.published
    return gpu.memory_bandwidth * (measured.hbm.value if measured else 1.0)


def _tile_seconds(gpu, tm: int, tn: int, k: int, element: int, per_sm: float) -> float:
    """One tile: its k-blocks through the pipeline (the stages but one filled first), then its epilogue's writes."""
    stages = gpu.published.gemm_stages if gpu.published else DEFAULT_STAGES
    k_block, blocks = 2.0 * tm * tn * TILE_K / per_sm, math.ceil(k / TILE_K)
    return k_block * (blocks + min(stages - 1, blocks)) + tm * tn * element / (hbm_bandwidth(gpu) / gpu.sms)


def _waves(gpu, batch, m, n, k, element, per_sm) -> float:
    return min(
        math.ceil(batch * math.ceil(m / tm) * math.ceil(n / tn) / gpu.sms)
        * _tile_seconds(gpu, tm, tn, k, element, per_sm)
        for tm, tn in TILES
    )


def sm_rate(gpu, dtype: str) -> float:
    """FLOP/s of one SM's k-blocks: what makes the tiled model reproduce the published GEMM rate at its shape
    (solved in closed form: for each tile, seconds = A / rate + epilogue), scaled to `dtype`'s peak."""
    peak = gpu.flops_per_s(dtype)
    measured = gpu.published
    if measured is None:
        return peak * gpu.matmul_efficiency / gpu.sms
    batch, m, n, k = measured.gemm_shape
    target = 2.0 * batch * m * n * k / (measured.gemm_rate.value * gpu.flops_per_s("bf16"))
    stages, hbm_sm = measured.gemm_stages, hbm_bandwidth(gpu) / gpu.sms
    rates = []
    for tm, tn in TILES:
        waves = math.ceil(batch * math.ceil(m / tm) * math.ceil(n / tn) / gpu.sms)
        blocks = math.ceil(k / TILE_K)
        work = waves * 2.0 * tm * tn * TILE_K * (blocks + min(stages - 1, blocks))
        epilogue = waves * tm * tn * 2 / hbm_sm
        rates.append(work / (target - epilogue))
    return min(rates) * peak / gpu.flops_per_s("bf16")


def tiled_seconds(gpu, batch: int, m: int, n: int, k: int, dtype: str) -> float:
    """batch x (m x k) @ (k x n) as tiles in waves on the SMs, at the rate that reproduces the published shape."""
    return _waves(gpu, batch, m, n, k, ELEMENT_BYTES.get(dtype, 2), sm_rate(gpu, dtype))


def gemm_seconds(gpu, batch: int, m: int, n: int, k: int, dtype: str) -> float:
    """Device seconds of batch x (m x k) @ (k x n), compute-bound part only (tiles in waves on the SMs, never faster
    than the fastest GEMM measured on the GPU: `gemm_ceiling`)."""
    flops = 2.0 * batch * m * n * k
    if not gpu.sms:  # no SMs to fill (a CPU): the rate measured at the nearest sizes
        return flops / measured_rate(gpu, flops / batch, dtype)
    tiled = tiled_seconds(gpu, batch, m, n, k, dtype)
    if gpu.published is None:
        return tiled
    return max(tiled, flops / (gpu.published.gemm_ceiling.value * gpu.flops_per_s(dtype)))


def measured_rate(gpu, flops: float, dtype: str) -> float:
    """FLOP/s of one GEMM of `flops` where the rate was measured by size (log-linear between the sizes measured,
    the nearest one's beyond them); the peak x matmul_efficiency where it was not."""
    points = sorted(gpu.gemm_rates.get(dtype, ()))
    if not points:
        return gpu.flops_per_s(dtype) * gpu.matmul_efficiency
    return interpolate(points, flops)


def interpolate(points, x: float) -> float:
    """y at x on a curve of (x, y) points, log-log between them, the nearest end's y beyond them."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 * (y1 / y0) ** (math.log(x / x0) / math.log(x1 / x0))
    return points[-1][1]


def gemm_efficiency(gpu, batch: int, m: int, n: int, k: int, dtype: str = "bf16") -> float:
    """The fraction of the datasheet peak this GEMM shape reaches."""
    return 2.0 * batch * m * n * k / gemm_seconds(gpu, batch, m, n, k, dtype) / gpu.flops_per_s(dtype)


def attention_rate(gpu, heads_batch: int, queries: int, head_dim: int, causal: bool) -> float:
    """FLOP/s (FlashAttention-2's count) of a fused attention: the published rate at this head dimension and
    sequence length (log-linear in the length, linear in the head dimension between 64 and 128, the nearest
    measured beyond), times how well its blocks fill the SMs over how well the benchmark's did."""
    measured = gpu.published
    table = measured.attention
    dims = sorted({d for c, d in table if c == causal})
    lo = max([d for d in dims if d <= head_dim], default=dims[0])
    hi = min([d for d in dims if d >= head_dim], default=dims[-1])
    at = {d: interpolate(table[(causal, d)], queries) for d in (lo, hi)}
    rate = at[lo] if lo == hi else at[lo] + (at[hi] - at[lo]) * (head_dim - lo) / (hi - lo)

    def filled(ctas):
        return ctas / (math.ceil(ctas / gpu.sms) * gpu.sms)

    blocks = math.ceil(queries / ATTENTION_BLOCK)
    bench = max(measured.attention_tokens // queries, 1) * max(FA2_HIDDEN // max(head_dim, 1), 1) * blocks
    return rate * 1e12 * measured.attention_scale.value * filled(heads_batch * blocks) / filled(bench)


def attention_seconds(gpu, kernel: Kernel) -> float:
    """Device seconds of a fused attention kernel: FlashAttention-2's work (4 b h s_q s_k d forward, 2.5 times that
    backward, which recomputes the scores; half of it under a causal mask) at its published rate."""
    batch, heads, queries, keys, head_dim, causal, backward = kernel.shape
    work = 4.0 * batch * heads * queries * keys * head_dim * (0.5 if causal else 1.0) * (2.5 if backward else 1.0)
    if gpu.published is None or not gpu.sms:
        return work / (gpu.flops_per_s(kernel.dtype) * gpu.matmul_efficiency)
    return work / attention_rate(gpu, batch * heads, queries, head_dim, causal)


def device_seconds(gpu, kernel: Kernel) -> float:
    """Seconds one kernel keeps the device busy: the slower of its compute and its memory traffic."""
    memory = kernel.bytes / hbm_bandwidth(gpu)
    if kernel.kind == "gemm":
        return max(gemm_seconds(gpu, *kernel.shape, kernel.dtype), memory)
    if kernel.kind == "attention":
        return max(attention_seconds(gpu, kernel), memory)
    compute = kernel.flops / gpu.flops_per_s("fp32") if kernel.flops else 0.0
    return max(compute, memory)


def segment_parts(segment: Compute, gpu, cache: dict | None = None) -> dict:
    """Device seconds of a compute segment by kind of kernel: {"gemm", "attention", "memory_bound"}."""
    parts = {"gemm": 0.0, "attention": 0.0, "memory_bound": 0.0}
    for kernel, count in segment.kernels:
        if cache is None:
            seconds = device_seconds(gpu, kernel)
        else:
            if kernel not in cache:
                cache[kernel] = device_seconds(gpu, kernel)
            seconds = cache[kernel]
        parts[kernel.kind if kernel.kind in parts else "memory_bound"] += count * seconds
    return parts


def segment_seconds(segment: Compute, gpu, cache: dict | None = None) -> tuple[float, float]:
    """(seconds, device seconds) of a compute segment priced kernel by kernel (rule 4 for the host)."""
    device = sum(segment_parts(segment, gpu, cache).values())
    host = segment.ops * gpu.op_overhead
    return (max(device, host) if gpu.asynchronous else device + host), device
