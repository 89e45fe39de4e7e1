"""The memory and communication theory, checked against the papers' own numbers."""

import math

import pytest

from toolkit import memory
from toolkit.memory import (
    activation_bytes,
    alpha_beta_time,
    bytes_on_wire,
    communication_per_step,
    deepspeed_zero2_estimate,
    deepspeed_zero3_estimate,
    flat_padding,
    fsdp_cross_host_traffic,
    fsdp_peak_params,
    model_states,
    model_states_breakdown,
    ring_all_gather_bytes,
    ring_all_reduce_bytes,
    ring_reduce_scatter_bytes,
)

GB = 1e9


@pytest.mark.parametrize("stage, expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1(stage, expected_gb):
    # Ψ = 7.5B, N = 64, K = 12 (ZeRO paper, Figure 1)
    assert round(model_states(7.5e9, 64, stage) / GB, 1) == expected_gb


def test_zero_stage_formulas_exactly():
    psi, n, k = 1000, 8, 12
    assert model_states(psi, n, 0) == (2 + 2 + k) * psi
    assert model_states(psi, n, 1) == 4 * psi + k * psi / n
    assert model_states(psi, n, 2) == 2 * psi + (2 + k) * psi / n
    assert model_states(psi, n, 3) == (2 + 2 + k) * psi / n


def test_headline_sizes():
    assert model_states(1e9, optimizer_multiplier=16) / GB == pytest.approx(20.0)  # K = 16 lectures
    assert model_states(175e9) / GB == pytest.approx(2800.0)  # GPT-3 scale, K = 12


def test_breakdown_sums_and_keys():
    parts = model_states_breakdown(7.5e9, 64, 2)
    assert set(parts) == {"params", "grads", "optimizer"}
    assert parts["params"] == 2 * 7.5e9
    assert parts["grads"] == 2 * 7.5e9 / 64
    assert parts["optimizer"] == 12 * 7.5e9 / 64
    assert sum(parts.values()) == model_states(7.5e9, 64, 2)


def test_fp32_everything():
    # fp32 params and grads with Adam's two fp32 states: 4 + 4 + 8 = 16 bytes per parameter
    assert model_states(10, param_bytes=4, grad_bytes=4, optimizer_multiplier=8) == 160


def test_one_rank_all_stages_agree():
    assert {model_states(123, 1, s) for s in range(4)} == {16 * 123}


def test_communication_volumes():
    psi, n = 1e6, 8
    dp = communication_per_step(psi, n, "ddp")
    assert dp == pytest.approx(2 * psi * 7 / 8)
    for strategy in ("dp", "zero1", "zero2"):
        assert communication_per_step(psi, n, strategy) == dp
    assert communication_per_step(psi, n, "zero3") == pytest.approx(1.5 * dp)
    assert communication_per_step(psi, n, "fsdp") == pytest.approx(1.5 * dp)
    assert communication_per_step(psi, n, "local") == 0
    assert communication_per_step(psi, 1, "zero3") == 0


def test_accumulation_reduces_once_where_no_sync_can_hold_the_gradients_back():
    """4 micro-batches on 8 ranks, in passes of Ψ(N-1)/N: DDP all-reduces once (2 passes) under no_sync, 4 times
    without; ZeRO-2 and ZeRO-3 keep only a slice, so reduce-scatter every micro-batch (ZeRO-2 gathers the updated
    parameters once, ZeRO-3 gathers them in each micro-batch's forward and backward); FSDP's no_sync keeps whole
    gradients and reduce-scatters once."""
    psi, n = 1e6, 8
    one_pass = psi * 7 / 8
    expected = {  # strategy: (no_sync, every micro-batch reduced)
        "dp": (2, 8),
        "ddp": (2, 8),
        "zero1": (2, 5),
        "zero2": (5, 5),
        "zero3": (12, 12),
        "fsdp": (9, 12),
        "local": (0, 0),
    }
    for strategy, (held, each) in expected.items():
        assert communication_per_step(psi, n, strategy, accumulation=4) == pytest.approx(held * one_pass), strategy
        got = communication_per_step(psi, n, strategy, accumulation=4, no_sync=False)
        assert got == pytest.approx(each * one_pass), strategy
        assert communication_per_step(psi, n, strategy, accumulation=1) == communication_per_step(psi, n, strategy)
    with pytest.raises(ValueError, match="accumulation must be a positive integer"):
        communication_per_step(psi, n, "ddp", accumulation=0)


def test_ring_volumes():
    assert ring_all_reduce_bytes(1000, 4) == 1500
    assert ring_reduce_scatter_bytes(1000, 4) == 750
    assert ring_all_gather_bytes(1000, 4) == 750
    assert ring_all_reduce_bytes(1000, 4) == ring_reduce_scatter_bytes(1000, 4) + ring_all_gather_bytes(1000, 4)
    assert ring_all_reduce_bytes(1000, 1) == 0
    assert bytes_on_wire("all_to_all", 1000, 4) == 750
    assert bytes_on_wire("broadcast", 1000, 4) == 1000


def test_alpha_beta_time():
    alpha, beta = 1e-5, 1e-9  # 10 us per message, 1 GB/s
    assert alpha_beta_time("all_reduce", 1e6, 4, alpha, beta) == pytest.approx(6 * alpha + 1.5e6 * beta)
    assert alpha_beta_time("reduce_scatter", 1e6, 4, alpha, beta) == pytest.approx(3 * alpha + 0.75e6 * beta)
    assert alpha_beta_time("all_gather", 1e6, 4, alpha, beta) == pytest.approx(3 * alpha + 0.75e6 * beta)
    assert alpha_beta_time("broadcast", 1e6, 4, alpha, beta) == pytest.approx(3 * alpha + 1e6 * beta)
    assert alpha_beta_time("all_to_all", 1e6, 4, alpha, beta) == pytest.approx(3 * alpha + 0.75e6 * beta)
    assert alpha_beta_time("all_reduce", 1e6, 1, alpha, beta) == 0
    # small messages are latency-bound, large ones bandwidth-bound
    assert alpha_beta_time("all_reduce", 8, 64, alpha, beta) == pytest.approx(126 * alpha, rel=1e-3)


def test_fsdp_peak_params():
    assert fsdp_peak_params([10, 30, 20], 4) == 60 / 4 + 30
    assert fsdp_peak_params([10, 30, 20], 4, in_flight=2) == 60 / 4 + 2 * 30
    assert fsdp_peak_params([10, 30, 20], 1) == 60  # nothing sharded, nothing gathered
    # finer wrapping lowers the peak: one big unit vs. three units of the same total
    assert fsdp_peak_params([60], 4) > fsdp_peak_params([20, 20, 20], 4)


def test_flat_padding():
    assert flat_padding(105, 4) == 3
    assert flat_padding(104, 4) == 0
    assert all(flat_padding(n, 8) < 8 for n in range(100))


def test_fsdp_cross_host_traffic_worked_example():
    # M = 10 GB, 8 GPUs per host, 64 GPUs
    M, G, W = 10.0, 8, 64
    assert fsdp_cross_host_traffic(M, G, W, "full_replication") == pytest.approx(19.6875)  # 2·10·63/64
    assert fsdp_cross_host_traffic(M, G, W, "full_shard") == pytest.approx(29.53125)  # 3·10·63/64
    assert fsdp_cross_host_traffic(M, G, W, "hybrid") == pytest.approx(2.4609375)  # 2·10·63/(8·64)
    assert fsdp_cross_host_traffic(M, G, W) == fsdp_cross_host_traffic(M, G, W, "hybrid")
    ratio = fsdp_cross_host_traffic(M, G, W, "hybrid") / fsdp_cross_host_traffic(M, G, W, "full_replication")
    assert ratio == pytest.approx(1 / G)


def test_activation_bytes_gpt3_layer():
    # GPT-3 175B: s = 2048, h = 12288, a = 96, b = 1 -> sbh·(34 + 80) per layer
    per_layer = activation_bytes(2048, 1, 12288, 96)
    assert per_layer == 2048 * 12288 * 114
    assert activation_bytes(2048, 1, 12288, 96, layers=96) == pytest.approx(96 * per_layer)
    # the attention term is quadratic in the sequence length
    assert activation_bytes(4096, 1, 64, 4) - 2 * activation_bytes(2048, 1, 64, 4) == pytest.approx(
        5 * 4 * 1 * (4096**2 - 2 * 2048**2)
    )


def test_deepspeed_estimators():
    assert deepspeed_zero2_estimate(1e9, 8) == pytest.approx(2e9 + 18e9 / 8)
    assert deepspeed_zero3_estimate(1e9, 1e8, 8) == pytest.approx(4e8 + 18e9 / 8)
    # the estimator counts more than the textbook: 18 bytes of sharded state, not 14
    assert deepspeed_zero2_estimate(1e9, 8) > model_states(1e9, 8, 2)


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: model_states(1e9, 8, 4), ["stage", "0", "3"]),
        (lambda: model_states(1e9, 0, 1), ["world_size", "positive"]),
        (lambda: model_states(1e9, 2.5, 1), ["world_size"]),
        (lambda: model_states(-1, 8, 1), ["num_params"]),
        (lambda: model_states_breakdown(1e9, 8, "zero2"), ["stage", "0, 1, 2, 3"]),
        (lambda: communication_per_step(1e9, 8, "zero4"), ["strategy", "'ddp'", "'zero3'", "'fsdp'"]),
        (lambda: alpha_beta_time("allreduce", 1e6, 4, 1e-5, 1e-9), ["collective", "'all_reduce'", "'all_to_all'"]),
        (lambda: alpha_beta_time("all_reduce", 1e6, 4, -1, 1e-9), ["alpha"]),
        (lambda: ring_all_reduce_bytes(1000, 0), ["n", "positive"]),
        (lambda: fsdp_peak_params([], 4), ["unit_sizes"]),
        (lambda: fsdp_peak_params([1, 2], 0), ["sharding_factor"]),
        (lambda: fsdp_cross_host_traffic(1.0, 8, 12), ["multiple", "gpus_per_host"]),
        (lambda: fsdp_cross_host_traffic(1.0, 8, 64, "zero3"), ["'hybrid'", "'full_shard'"]),
        (lambda: activation_bytes(0, 1, 64, 4), ["seq_len"]),
    ],
)
def test_errors_name_the_valid_values(call, words):
    with pytest.raises(ValueError) as info:
        call()
    for word in words:
        assert word in str(info.value)


def test_package_reexports():
    for name in (
        "model_states",
        "model_states_breakdown",
        "communication_per_step",
        "alpha_beta_time",
        "fsdp_peak_params",
        "fsdp_cross_host_traffic",
        "activation_bytes",
    ):
        assert callable(getattr(memory, name))
    assert math.isclose(memory.model_states(7.5e9, 64, 3) / GB, 1.875)
