"""Traces: spans on one aligned clock, the Run record, and Chrome trace JSON that Perfetto opens."""

import json
import time

import pytest
import torch

import toolkit
from toolkit import comm
from toolkit.run import Run
from toolkit.trace.chrome import save_chrome, to_chrome

pytestmark = pytest.mark.timeout(120)


def _traced_work():
    import torch.distributed as dist

    r = dist.get_rank()
    toolkit.trace.recorder.reset()
    with toolkit.trace.phase("forward"), toolkit.trace.span("forward"):
        time.sleep(0.05)
        comm.all_reduce(torch.ones(256))
    handle = comm.all_reduce(torch.ones(16), async_op=True)
    time.sleep(0.3)  # the all-reduce finished long before we wait for it
    before_wait = time.time()
    handle.wait()
    toolkit.trace.recorder.metric("loss", 2.0 - r, step=0)
    toolkit.trace.recorder.sample(step=0, params=100 * (r + 1))
    run = Run.capture({"lesson": "trace"})
    return run, before_wait - run.meta["clock_offset_s"]


def test_runs_merge_align_and_export(tmp_path, no_leftover_ranks):
    results = toolkit.launch(_traced_work, 3, timeout_s=30)
    runs = [r for r, _ in results]
    merged = Run.merge(runs)
    assert merged.ranks == [0, 1, 2] and merged.meta["world_size"] == 3
    assert merged.config == {"lesson": "trace"}

    # the first all-reduce is a rendezvous: on an aligned clock all ranks leave it at about the same time
    ends = [e["end"] for e in merged.comm_events(name="all_reduce") if e["args"]["numel"] == 256]
    assert len(ends) == 3 and max(ends) - min(ends) < 0.05
    # compute span contains the collective issued inside it, and both carry the phase
    for rank in range(3):
        fwd = [e for e in merged.events if e["rank"] == rank and e["cat"] == "compute"][0]
        ar = merged.comm_events(rank, "all_reduce")[0]
        assert fwd["start"] <= ar["start"] <= ar["end"] <= fwd["end"] and ar["phase"] == "forward"
    # an async collective ends when it completed, not when somebody waited for it
    for rank, (_, before_wait) in enumerate(results):
        late = [e for e in merged.comm_events(rank) if e["args"]["numel"] == 16][0]
        assert late["end"] < before_wait - 0.1
    assert merged.metric("loss") == [(0, 2.0)] and merged.metric("loss", rank=2) == [(0, 0.0)]
    assert sorted(s["params"] for s in merged.samples) == [100, 200, 300]
    assert merged.bytes_sent(0) == 2 * 2 * (256 + 16) * 4 // 3

    path = tmp_path / "run.json"
    merged.save(path)
    again = Run.load(path)
    assert again.events == json.loads(json.dumps(merged.events)) and again.meta == merged.meta

    trace_path = tmp_path / "trace.json"
    save_chrome(merged, trace_path)
    trace = json.loads(trace_path.read_text())
    _check_chrome_structure(trace, ranks=[0, 1, 2])


def _check_chrome_structure(trace, ranks):
    """The Trace Event Format as chrome://tracing and Perfetto read it."""
    assert set(trace) >= {"traceEvents", "displayTimeUnit"}
    events = trace["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {(r, f"rank {r}") for r in ranks}
    threads = {(e["pid"], e["tid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    for r in ranks:
        assert (r, 0, "compute") in threads and (r, 1, "communication") in threads
    spans = [e for e in events if e["ph"] == "X"]
    assert spans
    for e in spans:
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0 and e["dur"] >= 0
        assert e["tid"] == {"comm": 1, "compute": 0, "wait": 0}.get(e["cat"], e["tid"]) and e["pid"] in ranks
        if e["cat"] == "comm":
            assert {"bytes_sent", "group", "dtype", "phase"} <= set(e["args"])


def test_run_load_rejects_other_json(tmp_path):
    path = tmp_path / "other.json"
    path.write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="not a saved toolkit Run"):
        Run.load(path)


def test_merge_needs_runs():
    with pytest.raises(ValueError, match="at least one Run"):
        Run.merge([])


def test_chrome_export_of_a_hand_made_run():
    run = Run(
        meta={"ranks": [0, 1]},
        events=[
            {
                "name": "forward",
                "cat": "compute",
                "phase": "forward",
                "rank": 0,
                "start": 10.0,
                "end": 10.5,
                "args": {},
            },
            {
                "name": "all_reduce",
                "cat": "comm",
                "phase": "backward",
                "rank": 1,
                "start": 10.25,
                "end": 10.75,
                "args": {"bytes_sent": 8, "group": [0, 1], "dtype": "float32"},
            },
            {"name": "unit 2", "cat": "fsdp", "phase": "forward", "rank": 0, "start": 10.0, "end": 10.1, "args": {}},
            {"name": "wait", "cat": "wait", "phase": "backward", "rank": 1, "start": 10.5, "end": 10.75, "args": {}},
        ],
    )
    trace = to_chrome(run)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(round(e["ts"]), round(e["dur"]), e["tid"]) for e in spans] == [
        (0.0, 500000.0, 0),
        (250000.0, 500000.0, 1),
        (0.0, 100000.0, 2),
        (500000.0, 250000.0, 0),
    ]
    threads = {(e["pid"], e["tid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert (0, 2, "FSDP units") in threads and not any(name == "wait" for _, _, name in threads)
