"""bench/context_parallel.py, briefly: torch's `context_parallel` has no CPU kernel (the bench reports what it
raises; when torch adds one, this test says the docs must change), and beside torch's ring templates on the same
kernel and shards the toolkit's ring gives the same output and gradients and sends 3(cp-1)/cp of the sequence's K
and V where torch sends 2(cp-1)/cp + 1. The time ratio is the bench's to measure (docs/benchmarks.md)."""

import pytest
from bench_module import load

import toolkit


@pytest.mark.timeout(300)
def test_beside_torchs_ring_the_same_attention_and_fewer_bytes(no_leftover_ranks):
    bench = load("context_parallel")
    got = toolkit.launch(bench.run_all, 2, args=(2, (256,)), timeout_s=240, quiet=True)
    whole_kv = 2 * bench.BATCH * bench.HEADS * 256 * bench.HEAD_DIM * 4  # fp32 K and V of the whole sequence
    for rank in got:
        assert rank["torch context_parallel"].startswith(
            "NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu"
        )
        r = rank[256]
        assert max(side["difference"] for side in r.values()) < 1e-5, r
        assert r["toolkit"]["bytes"] == 3 * whole_kv // 2
        assert r["torch allgather"]["bytes"] == r["torch alltoall"]["bytes"] == (2 * 1 // 2 + 1) * whole_kv
    assert f"| 256 | {got[0][256]['toolkit']['seconds'] * 1e3:.1f} |" in bench.table(got[0], (256,))
