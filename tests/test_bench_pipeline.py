"""bench/pipeline.py runs both pipelines on the same model and batches: the toolkit's and torch's
(torch.distributed.pipelining) compute the same losses, and the table says what was measured."""

import pytest
from bench_module import load

import toolkit


@pytest.mark.timeout(180)
def test_both_pipelines_compute_the_same_losses(no_leftover_ranks):
    bench = load("pipeline")
    results = toolkit.launch(bench.run_all, 2, args=(3, 2), timeout_s=150, quiet=True)[0]
    for schedule in ("gpipe", "1f1b"):
        row = results[schedule]
        assert row["loss_diff"] == 0.0, schedule  # the same micro-batches, summed in the same order
        assert row["toolkit"] > 0 and row["torch"] > 0 and 0 <= row["toolkit_bubble"] < 1
    text = bench.table(results, 2)
    assert text.count("\n") == 3 and "| 33% |" in text  # (p-1)/(m+p-1) at p = m = 2
