"""`python -m toolkit compare` has an "hsdp" row: FSDP sharded within pairs of ranks, replicated across them."""

import pytest

from toolkit import compare, compare_theory


def test_hsdp_is_offered_beside_fsdp():
    assert compare.DEFAULT_STRATEGIES.index("hsdp") == compare.DEFAULT_STRATEGIES.index("fsdp") + 1
    assert "hsdp" in compare.available_strategies()


def test_hsdp_theory():
    psi = 1000
    t = compare_theory.hsdp_theory(psi, 4, mixed_precision=False)  # F = 2 shards, R = 2 replicas
    assert t["states"] == pytest.approx(16 * psi / 2)
    assert t["sent"] == pytest.approx((3 * psi / 2 + 2 * (psi / 2) / 2) * 4)
    t8 = compare_theory.hsdp_theory(psi, 8, mixed_precision=True)  # F = 2, R = 4, 16-bit on the wire
    assert t8["sent"] == pytest.approx((3 * psi / 2 + 2 * (psi / 2) * 3 / 4) * 2)


def test_hsdp_is_skipped_below_four_ranks():
    said = []
    runs, rows, _ = compare.training_section(2, ["hsdp"], 1, said.append)
    assert runs == {} and rows == [] and "skipped" in said[0]


@pytest.mark.timeout(240)
def test_hsdp_on_four_ranks_matches_local_and_its_theory(no_leftover_ranks):
    said = []
    runs, rows, _ = compare.training_section(4, ["local", "hsdp"], 2, said.append)
    row = {r["strategy"]: r for r in rows}["hsdp"]
    assert row["ranks"] == 4 and row["|loss - local|"] < 1e-5
    assert row["model states MB"] == pytest.approx(row["theory MB"], abs=0.002)  # padding, step counters
    assert row["sent MB/step"] == pytest.approx(row["theory sent MB/step"], abs=0.002)
    groups = {tuple(e["args"]["group"]) for e in runs["hsdp"].comm_events(0) if e["phase"] != "setup"}
    assert groups == {(0, 1), (0, 2)}  # shard group (0, 1), replica group (0, 2)
    assert "hsdp on 4 rank(s)" in said[1]
