"""The record of a run: what was configured, what happened on each rank, what was measured.

A rank captures its own `Run` at the end of its work and returns it; the launcher merges the ranks'
Runs into one, which the figures in `toolkit.viz` draw and `save` keeps as JSON. Everything is a flat
list of records tagged with its rank, so merging is concatenation and a figure is a filter.
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .comm.emulate import meta as _emulated_link
from .trace import events as _events


@dataclass
class Run:
    config: dict = field(default_factory=dict)
    events: list = field(default_factory=list)  # spans: name, cat (comm/compute), phase, rank, start, end, args
    samples: list = field(default_factory=list)  # memory: rank, time, phase, step, bytes per category
    metrics: list = field(default_factory=list)  # rank, name, step, value
    meta: dict = field(default_factory=dict)  # world size, backend, device, versions, emulation, ranks

    # --- making one ----------------------------------------------------------------------------
    @classmethod
    def capture(cls, config: dict | None = None, *, align: bool = True) -> Run:
        """Package this rank's recorder into a Run. Collective when `align`: every rank must call it."""
        if align:
            _events.align(_events.recorder)
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        events, samples, metrics = _events.recorder.finish(rank)
        meta = {
            "world_size": world,
            "ranks": [rank],
            "backend": dist.get_backend() if dist.is_initialized() else "none",
            "device": "cuda" if _events.recorder._on_gpu() else "cpu",
            "torch": torch.__version__,
            "host": platform.node(),
            "clock_offset_s": _events.recorder.clock_offset,
            "emulated_link": _emulated_link(),
        }
        return cls(dict(config or {}), events, samples, metrics, meta)

    @classmethod
    def merge(cls, runs) -> Run:
        """One Run from every rank's Run (or from several merged Runs)."""
        runs = list(runs)
        if not runs:
            raise ValueError("Run.merge needs at least one Run.")
        meta = dict(runs[0].meta)
        meta["ranks"] = sorted({r for run in runs for r in run.meta.get("ranks", [])})
        merged = cls(dict(runs[0].config), [], [], [], meta)
        for run in runs:
            merged.events += run.events
            merged.samples += run.samples
            merged.metrics += run.metrics
        merged.events.sort(key=lambda e: (e["start"], e["rank"]))
        return merged

    # --- reading one --------------------------------------------------------------------------
    @property
    def ranks(self) -> list[int]:
        return self.meta.get("ranks", sorted({e["rank"] for e in self.events}))

    def comm_events(self, rank: int | None = None, name: str | None = None) -> list[dict]:
        return [
            e
            for e in self.events
            if e["cat"] == "comm" and (rank is None or e["rank"] == rank) and (name is None or e["name"] == name)
        ]

    def metric(self, name: str, rank: int | None = None) -> list[tuple]:
        """[(step, value), ...] of one metric, on one rank (the lowest that has it when None)."""
        rows = [m for m in self.metrics if m["name"] == name]
        if rank is None and rows:
            rank = min(m["rank"] for m in rows)
        return [(m["step"], m["value"]) for m in rows if m["rank"] == rank]

    def bytes_sent(self, rank: int, phase: str | None = None) -> int:
        return sum(
            e["args"].get("bytes_sent", 0) for e in self.comm_events(rank) if phase is None or e["phase"] == phase
        )

    # --- keeping one ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "config": self.config,
            "events": self.events,
            "samples": self.samples,
            "metrics": self.metrics,
            "meta": self.meta,
        }

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, default=str)

    @classmethod
    def load(cls, path) -> Run:
        with open(path) as f:
            data = json.load(f)
        missing = {"config", "events", "samples", "metrics", "meta"} - set(data)
        if missing:
            raise ValueError(f"{path} is not a saved toolkit Run (missing {sorted(missing)}).")
        return cls(**data)
