"""The per-operation cost model: GEMM tiles and waves, fused attention, memory-bound kernels, the host's
launches, and what a simulated step's operations add up to (FLOPs against the papers' formula, MFU
against HFU). Every expected value is hand arithmetic from the datasheet numbers in `toolkit.sim.hardware`."""
import functools
import math
import subprocess
import sys

import pytest

from toolkit.models import tiny_gpt
from toolkit.models.as_in_papers import as_in, recompute_blocks
from toolkit.sim import Compute, GPUS, Kernel, cluster_of, estimate, simulate
from toolkit.sim.kernel_time import device_seconds, gemm_efficiency, gemm_seconds, segment_seconds

A100 = GPUS["a100-80gb"]
RATE = 312e12 * 267.9 / 312  # the best measured GEMM rate (MAMF)


# --- GEMMs -------------------------------------------------------------------------------------------------
def test_the_best_measured_shape_reaches_the_measured_rate_and_one_tile_more_costs_a_wave():
    """6912 x 16384 x 2048, the shape the MAMF microbenchmark found best on A100, is 3456 tiles of 256 x 128:
    exactly 32 waves on 108 SMs, so it runs at the measured rate. One SM's worth of 256 x 128 tiles (108 of
    them, one wave) against one column more: that needs a second wave of 256 x 128 tiles, so the fastest
    tile is then 128 x 64 (2 x 217 tiles: 5 waves of a quarter-size tile)."""
    assert gemm_efficiency(A100, 1, 6912, 16384, 2048) == pytest.approx(267.9 / 312, rel=1e-12)
    k, n = 4096, 128 * 108
    one_wave = gemm_seconds(A100, 1, 256, n, k, "bf16")
    assert one_wave == pytest.approx(2 * 256 * n * k / RATE, rel=1e-12)
    more = gemm_seconds(A100, 1, 256, n + 1, k, "bf16")
    assert more == pytest.approx(5 * 2 * 128 * 64 * k / (RATE / 108), rel=1e-12)
    assert more / one_wave == pytest.approx(1.25 * 256 * 128 * 108 / (256 * n), rel=1e-12)


def test_small_tiles_are_bound_by_l2_and_skinny_gemms_by_memory():
    """A 64 x 64 tile reads 128 operands per 8,192 FLOPs: at A100's L2 bandwidth (5120 B/clk at 1.41 GHz) that
    is 231 TFLOP/s, below the GEMM rate, so a GEMM that only 64 x 64 tiles fill well runs at that; a GEMM with
    a tiny k (a matrix-vector-like product) moves more bytes than it computes: device time is its bytes at
    HBM bandwidth."""
    l2_bound = 5120 * 1.41e9 * 2 * 64 * 64 / (128 * 2)
    assert l2_bound < RATE
    # 64 x 108 rows of 64: one wave of 64 x 64 tiles, 1.5 waves of anything wider
    t = gemm_seconds(A100, 1, 64 * 108, 64, 4096, "bf16")
    assert t == pytest.approx(min(2 * 64 * 108 * 64 * 4096 / l2_bound,
                                  2 * 2 * 128 * 64 * 4096 / (RATE / 108)), rel=1e-12)
    skinny = Kernel("mm", "gemm", 2.0 * 8192 * 8192 * 8, (8192 * 8 + 8 * 8192 + 8192 * 8192) * 2.0, "bf16",
                    (1, 8192, 8192, 8))
    assert device_seconds(A100, skinny) == pytest.approx(skinny.bytes / A100.memory_bandwidth, rel=1e-12)


def test_fused_attention_skips_the_masked_blocks_and_pays_its_softmax_at_the_fp32_rate():
    b, h, s, d = 4, 32, 2048, 128
    flops = 4.0 * b * h * s * s * d
    full = Kernel("flash", "attention", flops, 0.0, "bf16", (b, h, s, s, d, False, False))
    causal = Kernel("flash", "attention", flops, 0.0, "bf16", (b, h, s, s, d, True, False))
    ctas = b * h * (s // 128)  # 2048 blocks of 128 queries: 19 waves, the last one 104 of 108
    rate = RATE * ctas / (math.ceil(ctas / 108) * 108)
    expected = flops / rate + 8 * b * h * s * s / 19.5e12
    assert device_seconds(A100, full) == pytest.approx(expected, rel=1e-12)
    assert device_seconds(A100, causal) == pytest.approx(expected * (16 + 1) / 32, rel=1e-12)
    # FlashAttention-2 reports about 70% of peak forward at head dim 128 (Dao 2023): the model's 4d/(4d/0.86+8/19.5*312)
    assert 0.6 < flops / device_seconds(A100, full) / 312e12 < 0.8


# --- the host ------------------------------------------------------------------------------------------------
def test_launches_hide_behind_long_kernels_on_a_gpu_and_add_up_on_a_cpu():
    tiny = Kernel("add", "other", 0.0, 4e3, "bf16")  # 4 kB: 2 ns of HBM time, 5 us of launch
    big = Kernel("mm", "gemm", 2.0 * 16384 ** 3, 3 * 16384 ** 2 * 2.0, "bf16", (1, 16384, 16384, 16384))  # 33 ms
    many_tiny = Compute(0.0, 4e3 * 1000, ops=1000, kernels=((tiny, 1000),))
    assert segment_seconds(many_tiny, A100)[0] == pytest.approx(1000 * 5e-6)  # launch-bound
    with_big = Compute(big.flops, 0.0, ops=1001, kernels=((tiny, 1000), (big, 1)))
    seconds, device = segment_seconds(with_big, A100)
    assert seconds == device == pytest.approx(device_seconds(A100, big) + 1000 * device_seconds(A100, tiny))
    cpu = A100.__class__(**{**A100.__dict__, "asynchronous": False})
    assert segment_seconds(with_big, cpu)[0] == pytest.approx(device + 1001 * 5e-6)


# --- a simulated step's operations --------------------------------------------------------------------------
def megatron_gpt(n_layer=2, recompute=True, **shape):
    config = {**dict(vocab_size=512, seq_len=256, n_head=4, d_model=256), **shape}
    model = as_in(tiny_gpt(n_layer=n_layer, **config), "megatron")
    return recompute_blocks(model) if recompute else model


def test_executed_flops_are_megatrons_formula_and_hfu_counts_the_recomputation_that_mfu_leaves_out():
    """Narayanan et al. count 96 B s l h^2 (1 + s/6h + V/16lh) FLOPs per step with full recomputation. The
    simulated step of the same model (Megatron's attention kernels, every block recomputed) executes exactly
    that many (counted operation by operation with torch's flop registry), and MFU counts 3 x the forward
    pass: without recomputation the two agree; with it, HFU - MFU is the recomputed forward of the blocks."""
    B, s, h, L, V = 4, 256, 256, 2, 512
    common = dict(batch_per_rank=B, warmup=False, progress=False, mixed_precision=True, cluster="dgx-a100")
    with_rc = simulate(functools.partial(megatron_gpt, L), "ddp", 8, **common)
    plain = simulate(functools.partial(megatron_gpt, L, False), "ddp", 8, **common)
    formula = 96 * B * s * L * h ** 2 * (1 + s / (6 * h) + V / (16 * L * h))
    assert with_rc.flops == pytest.approx(formula, rel=1e-12)
    segments = [c for c in with_rc.programs[-1] if isinstance(c, Compute)]
    assert sum(k.flops * n for c in segments for k, n in c.kernels) == with_rc.flops
    assert with_rc.cost.model_flops[-1] == plain.cost.model_flops[-1] == pytest.approx(plain.flops, rel=1e-12)
    assert plain.hfu == pytest.approx(plain.mfu, rel=1e-12)
    blocks_forward = 24 * B * s * L * h ** 2 * (1 + s / (6 * h))  # what the recomputation runs again
    assert (with_rc.hfu - with_rc.mfu) * with_rc.step_time * 312e12 == pytest.approx(blocks_forward, rel=1e-9)


def test_the_per_operation_breakdown_adds_up_to_the_steps_compute():
    """At a 7B model's width the launches hide behind the kernels, so the step's compute is the sum of its
    operations' device times; at 8 sequences of 2048 the GEMMs dominate (the optimizer's elementwise update of
    two layers' fp32 states, memory-bound, comes next) and run at the shape's tile/wave efficiency."""
    sim = simulate(functools.partial(megatron_gpt, 2, d_model=4096, n_head=32, seq_len=2048), "ddp", 8,
                   batch_per_rank=8, warmup=False, progress=False, mixed_precision=True, cluster="dgx-a100")
    rows = sim.cost.per_op()
    assert sum(r["seconds"] for r in rows) == pytest.approx(sim.breakdown["compute"], rel=1e-9)
    gemm = sum(r["seconds"] for r in rows if r["kind"] == "gemm")
    assert 0.5 < gemm / sim.breakdown["compute"] < 1
    addmm = next(r for r in rows if r["name"] == "addmm")
    assert 0.5 < addmm["fraction_of_peak"] <= 267.9 / 312 + 1e-12
    assert 0 < sim.mfu < sim.hfu < 267.9 / 312


def test_an_h100_is_faster_by_its_gemm_rate_not_by_a_constant():
    sim = simulate(functools.partial(megatron_gpt, 2, d_model=4096, n_head=32, seq_len=2048), "ddp", 8,
                   batch_per_rank=1, warmup=False, progress=False, mixed_precision=True)
    a100, h100 = (estimate(sim.programs, name, world_size=8).breakdown["compute"] for name in ("dgx-a100", "dgx-h100"))
    # between the GEMM rates' ratio and the HBM bandwidths' ratio (the memory-bound kernels)
    assert 3350 / 2039 < a100 / h100 < 792.1 / 267.9


def test_pricing_a_simulation_never_imports_the_calibration():
    """The pricing of a simulation (`priced.py`) sits above the calibration it asks for "this-machine", which
    records its reference step from the pieces below both (no cycle); it imports it only when asked, so pricing
    on a GPU preset loads no measuring code."""
    code = ("import sys, toolkit.sim.cost, toolkit.sim.simulate, toolkit.sim.priced; "
            "assert 'toolkit.sim.calibrate' not in sys.modules, sorted(m for m in sys.modules if 'calib' in m)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_bad_accelerator_fields_get_a_clear_error():
    with pytest.raises(ValueError, match=r"matmul_efficiency=1.5: .* must be in \(0, 1\]"):
        cluster_of(dict(name="x", gpu=dict(name="g", peak_flops={"bf16": 1e15}, memory_bytes=1e10,
                                           memory_bandwidth=1e12, matmul_efficiency=1.5),
                        gpus_per_node=4, intra=("300 GB/s", "3 us"), inter=("100 Gb/s", "10 us")))
    with pytest.raises(ValueError, match=r"beside_compute=0.5 .* >= 1"):
        cluster_of("dgx-a100", beside_compute=0.5)
