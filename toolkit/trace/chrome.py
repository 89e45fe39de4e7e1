"""Export a Run to Chrome trace JSON, which opens in Perfetto (ui.perfetto.dev) and chrome://tracing.

One process row per rank; inside it one thread row for compute and one for communication, so
overlap is visible at a glance. Collective details (bytes, group, dtype) travel in `args`.
"""
from __future__ import annotations

import json

THREADS = {"compute": 0, "comm": 1}
LANE = dict(THREADS, wait=0)  # waiting on a collective blocks the compute lane


def to_chrome(run) -> dict:
    """The trace as a dict in the Trace Event Format ('X' complete events, microseconds)."""
    t0 = min((e["start"] for e in run.events), default=0.0)
    out = []
    for rank in run.ranks:
        out.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for label, tid in THREADS.items():
            out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                        "args": {"name": "communication" if label == "comm" else "compute"}})
    for e in run.events:
        duration = max(e["end"] - e["start"], 0.0)
        out.append({"ph": "X", "name": e["name"], "cat": e["cat"], "pid": e["rank"],
                    "tid": LANE.get(e["cat"], 2), "ts": (e["start"] - t0) * 1e6, "dur": duration * 1e6,
                    "args": dict(e["args"], phase=e["phase"])})
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {k: str(v) for k, v in run.meta.items()}}


def save_chrome(run, path) -> None:
    with open(path, "w") as f:
        json.dump(to_chrome(run), f, default=str)
