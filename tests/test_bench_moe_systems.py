"""bench/moe_systems.py: a tiny run measures every variant on a calibrated emulated link, and its section in
docs/benchmarks.md replaces only itself (the other benches' sections stay)."""

import pytest
from bench_module import load

import toolkit


def _bench():
    return load("moe_systems")


def test_section_is_appended_then_replaced_never_clobbering_others(tmp_path):
    bench = _bench()
    path = tmp_path / "benchmarks.md"
    path.write_text("# Benchmarks\n\n## MoE layer: toolkit vs DeepSpeed (bench/moe.py)\n\ndeepspeed table\n")
    bench.write_section(str(path), "first table", ["--repeats", "1"])
    with open(path, "a") as f:
        f.write("\n## FSDP\n\nfsdp table\n")
    bench.write_section(str(path), "second table", [])
    text = path.read_text()
    assert text.count(bench.SECTION) == 1 and "second table" in text and "first table" not in text
    assert "deepspeed table" in text and "## FSDP\n\nfsdp table" in text


def test_calibration_solves_the_link_model():
    bench = _bench()
    # two ranks' passes: the slowest rank computes 100 ms and moves 1 MB in 4 messages
    passes = [[{"comp": 0.1, "wire_bytes": 1e6, "messages": 4}], [{"comp": 0.05, "wire_bytes": 0.5e6, "messages": 4}]]
    bandwidth = bench.calibrate(passes, 1.0, 1e-3)
    assert 4 * 1e-3 + 1e6 / bandwidth == pytest.approx(0.1)  # R_CC = 1: link time = compute
    assert bench.calibrate(passes, 0.1, 1e-3) == pytest.approx(1e6 / (1.0 - 4e-3))
    with pytest.raises(ValueError, match="lower LATENCY_S"):
        bench.calibrate(passes, 1.0, 0.03)


def test_the_link_settles_in_a_closed_loop(monkeypatch):
    """The link as first calibrated is measured; while the plain path's R_CC is off by more than 5% the link is
    calibrated again on what was measured there (at most PROBES times), and each probe's R_CC is kept."""
    bench = _bench()
    loopback = [[{"comp": 0.1, "comm": 0.0, "wire_bytes": 1e6, "messages": 4}]]
    paces = iter([0.125, 0.13, 0.5])  # the experts' compute on the link, probe by probe

    def probe(cfg, variants, repeats, warmup, emulation):
        with emulation:  # as run_link: the link in force for this run only
            comm = 4 * bench.LATENCY_S + 1e6 / emulation.settings.inter.bandwidth  # the link's model time
        passes = [{"comp": next(paces), "comm": comm, "wire_bytes": 1e6, "messages": 4}] * repeats
        return {"passes": {"plain": passes}, "records": {"plain": []}}

    monkeypatch.setattr(bench, "run_link", probe)
    monkeypatch.setattr(bench, "_gathered", lambda result: [(result["passes"], result["records"])])
    bandwidth, probes = bench.settle({}, {}, loopback, 1.0)
    # as first calibrated the link takes the loopback compute, 0.1 s: 1.25 on the link; corrected to 0.125 s: 1.04
    assert probes == [pytest.approx(1.25), pytest.approx(0.13 / 0.125)]
    assert 4 * bench.LATENCY_S + 1e6 / bandwidth == pytest.approx(0.125)
    assert toolkit.comm.emulated_link() is None  # each probe's link was in force for its run only
    monkeypatch.setattr(bench, "PROBES", 1)  # one correction at most: the first probe's correction stands
    paces = iter([0.2])
    bandwidth, probes = bench.settle({}, {}, loopback, 1.0)
    assert probes == [pytest.approx(2.0)] and 4 * bench.LATENCY_S + 1e6 / bandwidth == pytest.approx(0.2)


@pytest.mark.timeout(180)
def test_a_tiny_run_measures_every_variant_on_a_calibrated_link(no_leftover_ranks):
    bench = _bench()
    cfg = dict(bench.CONFIG, tokens=256)
    variants = {name: bench.VARIANTS[name] for name in ("plain", "shadow auto", "pipeline 2", "smart")}
    (res, _) = toolkit.launch(bench.bench, 2, args=(cfg, ["comparable"], variants, 2, 1), timeout_s=120, quiet=True)
    link = res["links"]["comparable"]
    bandwidth, latency = link["params"]
    assert bandwidth > 0 and latency == bench.LATENCY_S and link["r_cc_target"] == 1.0
    assert 1 <= len(link["probes"]) <= bench.PROBES and all(r > 0 for r in link["probes"])
    summary = bench.summarize(link, cfg)
    assert set(summary["times"]) == set(variants) and all(t > 0 for t in summary["times"].values())
    assert summary["comm"] > 0 and summary["comp"] > 0 and summary["ideal_overlap"] >= 1.0
    assert summary["ideal_shadow"] > 0 and isinstance(summary["shadowed"], tuple)
    assert sum(summary["rank_rows"]) == sum(summary["counts"])  # dropless: every choice computed once
    assert summary["expert_max_over_mean"] > 1.3  # Zipf: the load is skewed
    text = bench.table([res], cfg)
    assert "emulated comparable" in text and "| 2 |" in text and "Load at world size 2" in text
    assert "1 round(s)" in text and "Targets (issue 6)" in text and "target 1.3x" in text
    assert "world size 2, comparable (target 1), each round: " in text  # the closed loop's probes
    twice = bench.table([res, res], cfg)  # two rounds: median and range
    assert "2 round(s)" in twice and twice.count("| 2 |") == 1 and "x (" in twice
