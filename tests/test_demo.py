"""`python -m toolkit demo`, quickly: a table on stdout, and a report, a Chrome trace and a Run on disk."""

import json
import re
import subprocess
import sys

import pytest

from toolkit import demo
from toolkit.comm.collectives import OPERATIONS
from toolkit.comm.measure import handwritten_operations, records_from_run
from toolkit.run import Run


@pytest.mark.timeout(240)
def test_quick_demo_on_two_ranks(tmp_path, capsys, no_leftover_ranks):
    full = tmp_path / "demo-report.html"  # what `make demo` wrote earlier: a quick look must leave it alone
    full.write_text("the full report")
    code = demo.main(["--world-size", "2", "--quick", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out

    header = next(line for line in out.splitlines() if line.startswith("operation"))
    assert header.split() == ["operation", "implementation", "size", "time", "algbw", "busbw", "agreement"]
    for op in OPERATIONS:
        assert re.search(rf"^{op}\s+backend", out, re.M), f"no backend row for {op}"
    if "all_reduce" in handwritten_operations():  # the hand-written ring is timed and agrees
        assert re.search(r"^all_reduce\s+hand-written ring .*yes", out, re.M)
    if "all_to_all" in handwritten_operations():  # the pairwise exchange, named as such
        assert re.search(r"^all_to_all\s+hand-written pairwise .*yes", out, re.M)
    assert "NO (" not in out

    assert full.read_text() == "the full report" and "the full report of `make demo` is still" in out
    report = (tmp_path / "demo-collectives-report.html").read_text(encoding="utf-8")
    assert "Plotly.newPlot" in report and not re.search(r"<script[^>]*src=[\"']?https?:", report)

    trace = json.loads((tmp_path / "demo-collectives-trace.json").read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "process_name"}
    assert processes == {0: "rank 0", 1: "rank 1"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = [e for e in trace if e["ph"] == "X"]
    for rank in (0, 1):
        comm = {e["tid"] for e in spans if e["pid"] == rank and e["cat"] == "comm"}
        compute = {e["tid"] for e in spans if e["pid"] == rank and e["cat"] == "compute"}
        assert len(comm) == 1 and len(compute) == 1 and comm != compute
        assert threads[(rank, comm.pop())] == "communication" and threads[(rank, compute.pop())] == "compute"

    run = Run.load(tmp_path / "demo-collectives-run.json")
    assert run.ranks == [0, 1] and run.meta["world_size"] == 2
    assert len(records_from_run(run)) == out.count(" KiB ")  # every table row is in the saved Run


def test_demo_refuses_a_world_of_one(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--world-size", "1"])
    assert "at least 2" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_demo_is_reachable_from_the_command_line():
    result = subprocess.run(
        [sys.executable, "-m", "toolkit", "demo", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "--world-size" in result.stdout and "--quick" in result.stdout
