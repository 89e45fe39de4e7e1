"""`make test-gpu` on a machine without CUDA: it says it skipped, and why, and exits 0; the kernel profile's code runs
on the CPU (`--cpu-dry-run`)."""

import os
import re
import subprocess
import sys

import bench_module
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_make_test_gpu_runs_the_gpu_suite():
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    target = re.search(r"^test-gpu:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert target and "bench/gpu_suite.py" in target.group(1) and "bench/kernel_profile.py" in target.group(1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: make test-gpu runs the real suite")
@pytest.mark.timeout(60)
def test_without_cuda_the_gpu_suite_skips_with_its_reason_and_exits_0():
    done = subprocess.run([sys.executable, "bench/gpu_suite.py"], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    assert "no CUDA device here" in done.stdout and "skipped" in done.stdout
    assert "--cpu-dry-run" in done.stdout  # and what to run instead


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: make test-gpu runs the real profile")
@pytest.mark.timeout(120)
def test_the_kernel_profile_skips_without_cuda_and_its_dry_run_fills_every_category():
    """Issue 30's open measurement (which kernels of an H100 step run slower than their price) is one command on a GPU
    machine; here its code runs on the CPU: every simulator category gets the operators its name says, and the
    table has a row for each, the step and the time no kernel ran."""
    skip = subprocess.run(
        [sys.executable, "bench/kernel_profile.py"], cwd=ROOT, capture_output=True, text=True, timeout=50
    )
    assert skip.returncode == 0 and "no CUDA device here" in skip.stdout, skip.stderr
    dry = subprocess.run(
        [sys.executable, "bench/kernel_profile.py", "--cpu-dry-run", "--steps", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert dry.returncode == 0, dry.stderr
    rows = {line.split(" | ")[0].strip("| "): line for line in dry.stdout.splitlines() if line.startswith("| ")}
    assert {"gemm", "attention", "memory-bound", "optimizer", "all kernels", "the step (wall)"} <= set(rows)
    assert float(rows["gemm"].split(" | ")[1]) > 0 and float(rows["attention"].split(" | ")[1]) > 0
    assert "No kernel running for" in dry.stdout


def test_kernels_are_put_in_the_simulators_categories_by_name():
    kp = bench_module.load("kernel_profile")
    assert kp.category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64") == "gemm"
    assert kp.category("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "gemm"
    assert kp.category("flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>") == "attention"
    assert kp.category("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)") == (
        "attention"
    )
    assert kp.category("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>") == "optimizer"
    assert kp.category("void at::native::vectorized_elementwise_kernel<4, GeluCUDAKernelImpl>") == "memory_bound"
    assert kp.category("aten::addmm") == "gemm" and kp.category("aten::layer_norm") == "memory_bound"


def test_each_gpu_a_lent_machine_may_have_gets_its_simulator_preset():
    """`make test-gpu` on an H200 (the kind a GPU machine here is often lent as) prices it, not skips it: the H100's
    compute with the H200's memory; a GPU the simulator has no preset for gets (None, None) and a skip line."""
    from toolkit.sim.hardware import cluster_of

    benchlib = bench_module.load("benchlib")

    name, h200 = benchlib.cluster_for("NVIDIA H200")
    h100 = cluster_of("dgx-h100")
    assert name == "dgx-h100 with H200 memory" and h200.gpu.memory_bandwidth == 4.8e12
    assert h200.gpu.peak_flops == h100.gpu.peak_flops and h200.gpu.published == h100.gpu.published
    assert benchlib.cluster_for("NVIDIA H100 80GB HBM3") == ("dgx-h100", "dgx-h100")
    assert benchlib.cluster_for("NVIDIA A100-SXM4-80GB") == ("dgx-a100", "dgx-a100")
    assert benchlib.cluster_for("NVIDIA GeForce RTX 4090") == (None, None)
