"""bench/moe.py: its section in docs/benchmarks.md leaves other sections alone, and without DeepSpeed it
still measures the toolkit's layer (time, all-to-all share) and says why DeepSpeed is missing."""

import pytest
from bench_module import load

import toolkit


def _bench():
    return load("moe")


def test_section_is_appended_then_replaced_never_clobbering_others(tmp_path):
    bench = _bench()
    path = tmp_path / "benchmarks.md"
    path.write_text("# Benchmarks\n\n## Strategies\n\nold strategies table\n")
    bench.write_section(str(path), "first table")
    bench.write_section(str(path), "second table")
    with open(path, "a") as f:
        f.write("\n## FSDP\n\nfsdp table\n")
    bench.write_section(str(path), "third table")
    text = path.read_text()
    assert text.count(bench.SECTION) == 1 and "third table" in text
    assert "first table" not in text and "second table" not in text
    assert "old strategies table" in text and "## FSDP\n\nfsdp table" in text
    assert "third table\n\n## FSDP" in text  # the next section keeps its blank line


@pytest.mark.timeout(120)
def test_without_deepspeed_the_toolkit_layer_is_still_measured(no_leftover_ranks):
    bench = _bench()
    reason = "deepspeed is not usable here (test)"
    (row,) = toolkit.launch(bench.bench, 2, args=(["small"], 2, 0, reason), timeout_s=60, quiet=True)[0]
    assert row["deepspeed"] == reason and "deepspeed_s" not in row
    assert row["toolkit_s"] > 0 and 0 < row["share"] < 1
    assert set(row["roles"]) == {"counts", "dispatch", "combine", "combine backward", "dispatch backward"}
    assert 0 < row["toolkit_dispatch_bytes"] < row["deepspeed_dispatch_bytes"] * 1.5
    text = bench.table([row])
    assert f"**DeepSpeed not measured:** {reason}" in text and "| small | 64 | 256 | 4 | 512 |" in text
