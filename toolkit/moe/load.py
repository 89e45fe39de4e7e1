"""The expert load: every rank records its own view of each forward (``record_load``); ``merge_load`` adds them up."""

from __future__ import annotations

from ..trace.events import recorder
from .gates import load_stats


def record_load(layer, routing, plan) -> None:
    """Record ``moe/{name}/load`` for ``layer``'s forward on this rank (this rank's view; sum over ranks
    for the global load, ``merge_load``):

    counts    [E]  (token, choice) pairs this rank routed to each global expert, before capacity
    kept      [E]  the same after capacity;  dropped = sum(counts) - sum(kept)
    capacity       slots per expert on this rank;  capacity_factor  the f it amounts to, C*E/(k*T)
    received  [E_local]  rows each of this rank's experts computed (from all ranks)
    first          global id of this rank's first expert
    max_over_mean, cv    imbalance of ``counts`` (``load_stats``)
    call           the layer's forward count on this rank
    The metric's step is the training loop's step when called inside its "forward" span.
    """
    if not recorder.enabled:
        return
    stats = load_stats(routing.counts)
    value = {
        "counts": routing.counts.tolist(),
        "kept": routing.kept_counts.tolist(),
        "dropped": routing.dropped,
        "capacity": routing.capacity,
        "received": plan.expert_rows,
        "capacity_factor": routing.capacity * layer.num_experts / max(1, routing.num_tokens * layer.top_k),
        "first": layer.experts.first,
        "max_over_mean": stats["max_over_mean"],
        "cv": stats["cv"],
        "call": layer.calls,
    }
    recorder.metric(f"moe/{layer.name}/load", value, step=enclosing_step())


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
    for event in reversed(recorder.events[-lookback:]):
        if event["name"] == "forward" and event["cat"] == "compute":
            return event["args"].get("step") if event["end"] is None else None
    return None
