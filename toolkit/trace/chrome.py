"""Export a Run to Chrome trace JSON, which opens in Perfetto (ui.perfetto.dev) and chrome://tracing.

One process row per rank; inside it one thread row for compute and one for communication, so
overlap is visible at a glance, and one more row for each other kind of span a strategy records
(FSDP's "fsdp" unit spans, say). Collective details (bytes, group, dtype) travel in `args`.
"""

from __future__ import annotations

import json

THREADS = {"compute": 0, "comm": 1}
NAMES = {"compute": "compute", "comm": "communication", "fsdp": "FSDP units", "moe": "MoE steps"}
SAME_ROW = {"wait": "compute"}  # waiting on a collective blocks the compute lane


def _lanes(run) -> dict:
    """Span category -> thread id: compute 0, communication 1, other categories after them in name order."""
    lanes = dict(THREADS)
    for cat in sorted({e["cat"] for e in run.events} - set(lanes) - set(SAME_ROW)):
        lanes[cat] = len(lanes)
    for cat, row in SAME_ROW.items():
        lanes[cat] = lanes[row]
    return lanes


def to_chrome(run) -> dict:
    """The trace as a dict in the Trace Event Format ('X' complete events, microseconds)."""
    t0 = min((e["start"] for e in run.events), default=0.0)
    lanes = _lanes(run)
    out = []
    for rank in run.ranks:
        out.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for cat, tid in lanes.items():
            if cat not in SAME_ROW:
                out.append(
                    {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": NAMES.get(cat, cat)}}
                )
    for e in run.events:
        duration = max(e["end"] - e["start"], 0.0)
        out.append(
            {
                "ph": "X",
                "name": e["name"],
                "cat": e["cat"],
                "pid": e["rank"],
                "tid": lanes[e["cat"]],
                "ts": (e["start"] - t0) * 1e6,
                "dur": duration * 1e6,
                "args": dict(e["args"], phase=e["phase"]),
            }
        )
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {k: str(v) for k, v in run.meta.items()}}


def save_chrome(run, path) -> None:
    with open(path, "w") as f:
        json.dump(to_chrome(run), f, default=str)
