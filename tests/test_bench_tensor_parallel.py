"""bench/tensor_parallel.py, briefly: beside torch's `parallelize_module` the toolkit's tensor parallelism sends
the same bytes per step to the byte and computes the same losses; the step-time ratio is the bench's to measure
(docs/benchmarks.md), never a test's.

Loss tolerance, fp32 (u = 2^-24): the two sides add the same terms in other orders; the loss (about 5.5 here, V
= 256) is a log-sum-exp over 256 terms: |Δ| <= 256 · u · 5.5 = 8.4e-5 -> 1e-4."""

import pytest
from bench_module import load

import toolkit

LOSS_ATOL = 1e-4


@pytest.mark.timeout(300)
@pytest.mark.parametrize("plan", ["mlp", "vocab"])
def test_beside_torchs_tensor_parallelism_the_same_bytes_and_losses(plan, no_leftover_ranks):
    bench = load("tensor_parallel")
    got = toolkit.launch(bench.compare, 2, args=(plan, 3), timeout_s=240, quiet=True)
    for rank in got:
        assert rank["toolkit_bytes"] == rank["torch_bytes"] > 0, rank
        assert rank["loss_diff"] <= LOSS_ATOL, rank
        assert rank["toolkit"] > 0 and rank["torch"] > 0
    text = bench.table({plan: got[0]})
    assert f"| {plan} |" in text and f"{got[0]['torch_bytes']:,}" in text
