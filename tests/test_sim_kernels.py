"""The per-operation cost model: GEMM tiles and waves, fused attention, memory-bound kernels, the host's
launches, and what a simulated step's operations add up to (FLOPs against the papers' formula, MFU
against HFU). Every expected value is hand arithmetic from the datasheet numbers in `toolkit.sim.hardware`."""

import dataclasses
import functools
import subprocess
import sys

import pytest

from toolkit.models import tiny_gpt
from toolkit.models.as_in_papers import as_in, recompute_blocks
from toolkit.sim import GPUS, Compute, Kernel, cluster_of, estimate, simulate
from toolkit.sim.breakdown import BUSY, WAITING
from toolkit.sim.cost import compute_time
from toolkit.sim.kernel_time import (
    device_seconds,
    gemm_efficiency,
    gemm_seconds,
    hbm_bandwidth,
    segment_seconds,
    sm_rate,
)
from toolkit.sim.priced import price

A100 = GPUS["a100-80gb"]


# --- GEMMs -------------------------------------------------------------------------------------------------
def test_a_gemm_is_tiles_in_waves_each_a_pipeline_of_k_blocks_then_its_epilogue():
    """2048 x 13824 is 864 tiles of 256 x 128: 8 whole waves on 108 SMs. A tile runs k / 64 k-blocks after the
    pipeline's other 2 stages filled (CUTLASS's 3), at the SM rate that reproduces cuBLASLt's 16384^3 (256.5
    TFLOP/s), then writes its 256 x 128 outputs at its SM's share of STREAM's bandwidth."""
    assert gemm_efficiency(A100, *A100.published.gemm_shape) == pytest.approx(256.5 / 312, rel=1e-12)
    per_sm, k = sm_rate(A100, "bf16"), 8192
    tile = 2 * 256 * 128 * 64 / per_sm * (k / 64 + 3 - 1) + 256 * 128 * 2 / (hbm_bandwidth(A100) / 108)
    assert gemm_seconds(A100, 1, 2048, 13824, k, "bf16") == pytest.approx(8 * tile, rel=1e-12)
    assert 0.8 < per_sm * 108 / 312e12 < 0.9  # the SMs' own rate: above the GEMM's, below the datasheet's


def test_a_gemm_with_one_k_block_fills_one_and_is_never_faster_than_its_bytes():
    """k = 8 is a single k-block (the pipeline has nothing more to fill) and a 256 x 128 tile of outputs to write:
    2048 tiles in 19 waves; its bytes at STREAM's bandwidth are a floor it stays above (a pipeline model: the
    writes of one tile and the loads of the next do not overlap)."""
    skinny = Kernel(
        "mm", "gemm", 2.0 * 8192 * 8192 * 8, (8192 * 8 + 8 * 8192 + 8192 * 8192) * 2.0, "bf16", (1, 8192, 8192, 8)
    )
    tile = 2 * 2 * 256 * 128 * 64 / sm_rate(A100, "bf16") + 256 * 128 * 2 / (hbm_bandwidth(A100) / 108)
    assert device_seconds(A100, skinny) == pytest.approx(19 * tile, rel=1e-12)
    assert skinny.bytes / hbm_bandwidth(A100) < device_seconds(A100, skinny) < 2 * skinny.bytes / hbm_bandwidth(A100)


# --- the host ------------------------------------------------------------------------------------------------
def test_launches_hide_behind_long_kernels_on_a_gpu_and_add_up_on_a_cpu():
    tiny = Kernel("add", "other", 0.0, 4e3, "bf16")  # 4 kB: 2 ns of HBM time, 5 us of launch
    big = Kernel("mm", "gemm", 2.0 * 16384**3, 3 * 16384**2 * 2.0, "bf16", (1, 16384, 16384, 16384))  # 33 ms
    many_tiny = Compute(0.0, 4e3 * 1000, ops=1000, kernels=((tiny, 1000),))
    assert segment_seconds(many_tiny, A100)[0] == pytest.approx(1000 * 5e-6)  # launch-bound
    with_big = Compute(big.flops, 0.0, ops=1001, kernels=((tiny, 1000), (big, 1)))
    seconds, device = segment_seconds(with_big, A100)
    assert seconds == device == pytest.approx(device_seconds(A100, big) + 1000 * device_seconds(A100, tiny))
    cpu = A100.__class__(**{**A100.__dict__, "asynchronous": False})
    assert segment_seconds(with_big, cpu)[0] == pytest.approx(device + 1001 * 5e-6)
    views = Compute(0.0, 0.0, ops=4)  # views alone, between two collectives: nothing for the device to run
    assert compute_time(views, A100) == 0.0  # the host, running ahead of the GPU, did them meanwhile
    assert compute_time(views, cpu) == pytest.approx(4 * 5e-6)  # a CPU's dispatches are its step's time


def test_the_per_operation_cost_is_charged_for_what_it_was_measured_on():
    """The calibration divides a tiny step's time by every operation it dispatches, views included
    (`count_ops`); a recorded program counts the same: the reference step's program, recorded on meta tensors,
    holds exactly the operations the real step dispatches (it held 361 of 521 when views were left out, so each
    of a step's views went unpriced and the reference step's scale made up for them in every rate)."""
    from toolkit.sim.calibrate import _reference_program
    from toolkit.sim.calibrate_compute import count_ops, reference_step

    step = reference_step()
    step()  # Adam makes its states in its first step: count a steady one, as the program is recorded
    assert sum(c.ops for c in _reference_program()) == count_ops(step)


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
    formula = 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
    assert with_rc.flops == pytest.approx(formula, rel=1e-12)
    segments = [c for c in with_rc.programs[-1] if isinstance(c, Compute)]
    assert sum(k.flops * n for c in segments for k, n in c.kernels) == with_rc.flops
    assert with_rc.cost.model_flops[-1] == plain.cost.model_flops[-1] == pytest.approx(plain.flops, rel=1e-12)
    assert plain.hfu == pytest.approx(plain.mfu, rel=1e-12)
    blocks_forward = 24 * B * s * L * h**2 * (1 + s / (6 * h))  # what the recomputation runs again
    assert (with_rc.hfu - with_rc.mfu) * with_rc.step_time * 312e12 == pytest.approx(blocks_forward, rel=1e-9)


def test_the_per_operation_breakdown_adds_up_to_the_steps_compute():
    """At a 7B model's width the launches hide behind the kernels, so the step's compute is the sum of its
    operations' device times, and its parts (GEMM, memory-bound, optimizer, beside the exposed communication) add
    up to the step; at 8 sequences of 2048 the GEMMs dominate and run at their shape's efficiency, below the
    published cuBLASLt rate; MFU below HFU below it."""
    sim = simulate(
        functools.partial(megatron_gpt, 2, d_model=4096, n_head=32, seq_len=2048),
        "ddp",
        8,
        batch_per_rank=8,
        warmup=False,
        progress=False,
        mixed_precision=True,
        cluster="dgx-a100",
    )
    rows, b = sim.cost.per_op(), sim.breakdown
    devices = sum(b[k] for k in ("gemm", "attention", "memory_bound", "optimizer"))
    assert sum(r["seconds"] for r in rows) == pytest.approx(devices, rel=1e-9)
    assert b["overhead"] == pytest.approx(0.0, abs=1e-9)  # the launches hide behind the kernels
    assert b["compute"] + b["exposed_comm"] == pytest.approx(b["step"], rel=1e-12) == sim.step_time
    assert b["compute"] == pytest.approx(devices + b["contention"], rel=1e-9) and b["contention"] > 0
    assert 0.5 < b["gemm"] / b["compute"] < 1
    addmm = next(r for r in rows if r["name"] == "addmm")
    assert 0.5 < addmm["fraction_of_peak"] <= 256.5 / 312 + 1e-12
    assert 0 < sim.mfu < sim.hfu < 256.5 / 312
    # on a CPU the host's dispatches add up, views between collectives too: launch overhead, not a roofline
    a100 = cluster_of("dgx-a100")
    cpu = price(sim, a100.with_changes(gpu=dataclasses.replace(a100.gpu, asynchronous=False))).breakdown
    assert cpu["overhead"] > 0 and "roofline" not in cpu
    assert sum(cpu[k] for k in (*BUSY, *WAITING) if k in cpu) == pytest.approx(cpu["step"], rel=1e-12)


def test_an_h100_is_faster_by_its_gemm_rate_not_by_a_constant():
    sim = simulate(
        functools.partial(megatron_gpt, 2, d_model=4096, n_head=32, seq_len=2048),
        "ddp",
        8,
        batch_per_rank=1,
        warmup=False,
        progress=False,
        mixed_precision=True,
    )
    a100, h100 = (estimate(sim.programs, name, world_size=8).breakdown["compute"] for name in ("dgx-a100", "dgx-h100"))
    # between the published GEMM rates' ratio and the HBM bandwidths' ratio (the memory-bound kernels)
    assert 2.935 / 1.655 < a100 / h100 < 783.3 / 256.5


def test_pricing_a_simulation_never_imports_the_calibration():
    """The pricing of a simulation (`priced.py`) sits above the calibration it asks for "this-machine", which
    records its reference step from the pieces below both (no cycle); it imports it only when asked, so pricing
    on a GPU preset loads no measuring code."""
    code = (
        "import sys, toolkit.sim.cost, toolkit.sim.simulate, toolkit.sim.priced; "
        "assert 'toolkit.sim.calibrate' not in sys.modules, sorted(m for m in sys.modules if 'calib' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_bad_accelerator_fields_get_a_clear_error():
    with pytest.raises(ValueError, match=r"matmul_efficiency=1.5: .* must be in \(0, 1\]"):
        cluster_of(
            dict(
                name="x",
                gpu=dict(
                    name="g", peak_flops={"bf16": 1e15}, memory_bytes=1e10, memory_bandwidth=1e12, matmul_efficiency=1.5
                ),
                gpus_per_node=4,
                intra=("300 GB/s", "3 us"),
                inter=("100 Gb/s", "10 us"),
            )
        )
    with pytest.raises(ValueError, match=r"beside_compute=0.5 .* >= 1"):
        cluster_of("dgx-a100", beside_compute=0.5)


# --- torch.autocast, which does not reach meta tensors ---------------------------------------------------------------
def _ops_and_grads(model, x, y, autocast: bool):
    """The aten operations (name, output dtypes) of one forward and backward, and the loss and gradients."""
    import collections
    import contextlib

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name != "view":  # a view moves no bytes; autocast takes the logits' before its cast, this after
                outs = out if isinstance(out, (tuple, list)) else (out,)
                self.ops[name, tuple(o.dtype for o in outs if isinstance(o, torch.Tensor))] += 1
            return out

    with Record() as record:
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            loss = model(x, y)
        loss.backward()
    return record.ops, loss, [p.grad for p in model.parameters()]


def test_under_autocast_runs_torch_autocasts_operations_and_numbers():
    """torch.autocast reaches no meta tensor, so the simulator could not price a run that used it (fp32 weights cast
    to 16 bits for each GEMM, their gradients cast back, LayerNorm and the residual stream in fp32). `under_autocast`
    writes those casts into the model: on CPU tensors it runs the operations torch.autocast runs, dtype for dtype,
    and gives its loss and gradients to the bit."""
    import copy

    import torch

    from toolkit.models.as_in_papers import under_autocast

    torch.manual_seed(0)
    gpt = tiny_gpt(n_layer=2, d_model=32, n_head=4, vocab_size=64, seq_len=16)
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    ops, loss, grads = _ops_and_grads(copy.deepcopy(gpt), x, y, autocast=True)
    ops_as, loss_as, grads_as = _ops_and_grads(under_autocast(copy.deepcopy(gpt), torch.bfloat16), x, y, False)
    assert ops_as == ops
    assert ("mm", (torch.bfloat16,)) in ops and ("native_layer_norm", (torch.float32,) * 3) in ops
    assert torch.equal(loss_as, loss) and all(torch.equal(a, b) for a, b in zip(grads_as, grads))
    assert all(g.dtype == torch.float32 for g in grads_as)
    _, loss_plain, _ = _ops_and_grads(copy.deepcopy(gpt), x, y, autocast=False)
    assert not torch.equal(loss_plain, loss)  # fp32 throughout is another number: the casts are what is compared
    with pytest.raises(ValueError, match="use torch.float16 or torch.bfloat16"):
        under_autocast(copy.deepcopy(gpt), torch.float32)


def test_a_model_under_autocast_is_priced_with_fp32_weights_and_16_bit_gemms():
    """Simulated on meta tensors: every GEMM in fp16, the weights and gradients in fp32 (8 bytes a parameter, where
    the bf16 recipe keeps 4 and fp32 masters in the optimizer), and more memory-bound time than the recipe's: the casts
    and the fp32 residual stream."""
    from toolkit.models.as_in_papers import under_autocast

    shape = dict(vocab_size=512, seq_len=64, n_layer=2, n_head=4, d_model=64)
    runs = {}
    for name, model_fn, precision in (
        ("autocast", lambda: under_autocast(tiny_gpt(**shape)), False),
        ("recipe", lambda: tiny_gpt(**shape), True),
    ):
        runs[name] = simulate(
            model_fn,
            "ddp",
            2,
            batch_per_rank=2,
            mixed_precision=precision,
            progress=False,
            warmup=False,
            cluster="dgx-a100",
        )
    kernels = [k for p in runs["autocast"].programs for c in p if hasattr(c, "kernels") for k, _ in c.kernels]
    assert {k.dtype for k in kernels if k.kind == "gemm"} == {"fp16"}
    breakdown = {name: sim.cost.breakdown for name, sim in runs.items()}
    assert breakdown["autocast"]["memory_bound"] > breakdown["recipe"]["memory_bound"]
