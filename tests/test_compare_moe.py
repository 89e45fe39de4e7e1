"""`python -m toolkit compare` trains the MoE-GPT with expert parallelism ("moe-ep") beside the dense strategies."""

import re

import pytest

from toolkit import compare, compare_theory


def test_moe_ep_is_offered_without_changing_the_strategies():
    assert compare.DEFAULT_STRATEGIES[:6] == ("local", "dp", "ddp", "zero1", "zero2", "zero3")
    assert compare.MOE_LABEL in compare.DEFAULT_STRATEGIES
    assert compare.MOE_LABEL in compare.available_strategies()


def test_moe_theory_counts_dense_all_reduce_and_all_to_alls():
    config = compare.TrainConfig(strategy="ddp", global_batch_size=8, model=dict(compare_theory.MODEL))
    t = compare_theory.moe_theory(2, config, mixed_precision=False)
    assert t["dense"] + t["experts"] == t["num_params"] and t["experts_per_rank"] * 2 == t["experts"]
    d, layers, tokens = compare_theory.MODEL["d_model"], compare_theory.MODEL["n_layer"], 4 * config.seq_len
    all_to_all = 4 * layers * tokens * 2 * (1 / 2) * d * 4 + layers * 4 * (1 / 2) * 8
    assert t["sent"] == pytest.approx(2 * t["dense"] * (1 / 2) * 4 + all_to_all)
    assert t["states"] == pytest.approx(16 * (t["dense"] + t["experts_per_rank"]))


@pytest.mark.timeout(180)
def test_compare_trains_moe_ep_and_reports_its_expert_load(no_leftover_ranks):
    said = []
    runs, rows, blocks = compare.training_section(2, ["moe-ep"], 2, said.append)
    (row,) = rows
    assert row["strategy"] == "moe-ep" and row["ranks"] == 2 and row["|loss - local|"] == "n/a"
    assert row["model states MB"] == row["theory MB"]  # dense + this rank's experts, measured = formula
    assert 0.5 * row["theory sent MB/step"] < row["sent MB/step"] <= 1.05 * row["theory sent MB/step"]
    moes = {e["args"].get("moe") for e in runs["moe-ep"].comm_events(0, "all_to_all")}
    assert moes == {"counts", "dispatch", "combine", "combine backward", "dispatch backward"}
    titles = [b.layout.title.text for b in blocks if hasattr(b, "layout")]
    assert any(t and t.startswith("Expert load of MoE layer 'layer0'") for t in titles), titles
    assert "moe-ep on 2 rank(s)" in said[0]
    # the gap to the balanced theory is the routing's: its recorded rows give the measured bytes exactly
    (note,) = [line for line in said if "moe-ep sent" in line]
    routed = float(re.search(r"recorded routing sent gives ([0-9.]+) MB", note).group(1))
    assert routed == pytest.approx(row["sent MB/step"], abs=0.0015), note
