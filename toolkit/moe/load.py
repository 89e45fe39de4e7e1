"""The global expert load: every rank records its own view of each forward; this adds them up."""

from __future__ import annotations

from .gates import load_stats


def merge_load(metrics, name: str = "moe") -> list:
    """The global expert load per forward of layer ``name``, from every rank's ``moe/{name}/load``.

    ``metrics``: a Run's ``metrics`` (each with "rank"). The i-th record of each rank belongs to the
    same forward. Returns, per forward: step, counts and kept summed over ranks, dropped, and
    ``load_stats`` of the global counts (max_over_mean, cv, ...).
    """
    per_rank = {}
    for m in metrics:
        if m["name"] == f"moe/{name}/load":
            per_rank.setdefault(m.get("rank", 0), []).append(m)
    rows = []
    for records in zip(*per_rank.values()):
        counts = [sum(c) for c in zip(*(r["value"]["counts"] for r in records))]
        kept = [sum(c) for c in zip(*(r["value"]["kept"] for r in records))]
        rows.append(
            {
                "step": records[0]["step"],
                "counts": counts,
                "kept": kept,
                "dropped": sum(r["value"]["dropped"] for r in records),
                **load_stats(counts),
            }
        )
    return rows


def enclosing_step(lookback: int = 256):
    """The step of the training loop's open "forward" span (see toolkit.train), or None: the step an
    MoE layer's records (load, placement, shadowing, pipeline) belong to."""
    from ..trace.events import recorder

    for event in reversed(recorder.events[-lookback:]):
        if event["name"] == "forward" and event["cat"] == "compute":
            return event["args"].get("step") if event["end"] is None else None
    return None
