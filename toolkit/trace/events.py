"""What happened on this rank, and when: spans of compute and communication, on one clock.

Every rank keeps one `Recorder`. The collectives door adds a span per collective; the training loop
adds forward/backward/optimizer spans. On a GPU the start and end of a span are CUDA events
(the host does not know when the device finished); on the CPU they are `time.perf_counter()`.
Either way they are turned into seconds on rank 0's wall clock when the Run is captured, so one
timeline lines up all ranks.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.distributed as dist

_phase = "idle"  # a process-wide label: autograd may call hooks from its own threads


def current_phase() -> str:
    return _phase


@contextlib.contextmanager
def phase(name: str):
    """Label everything recorded inside (collectives, spans) with a training phase."""
    global _phase
    before, _phase = _phase, name
    try:
        yield
    finally:
        _phase = before


class Recorder:
    """The spans of one rank. Markers are floats (CPU) or CUDA events, resolved at `finish()`."""

    def __init__(self):
        self.enabled = True
        self.listeners: list = []  # fn(kind, event) for kind "open"/"close" of every span (the simulator's seam)
        self.reset()

    def reset(self) -> None:
        self.events: list[dict] = []
        self.metrics: list[dict] = []  # {"name", "step", "value"}: losses, expert loads, choices made
        self.samples: list[dict] = []  # memory samples: {"time", "phase", "step", category: bytes, ...}
        self._cuda = None
        self.origin_pc, self.origin_wall = time.perf_counter(), time.time()
        self.clock_offset = 0.0  # this rank's wall clock minus rank 0's, estimated by align()

    # --- markers ---------------------------------------------------------------------------
    def _on_gpu(self) -> bool:
        if self._cuda is None:
            self._cuda = dist.is_initialized() and dist.get_backend() == "nccl"
            if self._cuda:
                torch.cuda.synchronize()
                self._ref_event = torch.cuda.Event(enable_timing=True)
                self._ref_event.record()
                torch.cuda.synchronize()
                self._ref_pc = time.perf_counter()
        return self._cuda

    def mark(self, stream=None):
        """A point in time: now on the host, or when `stream` gets here on the GPU."""
        if self._on_gpu():
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
            return event
        return time.perf_counter()

    def _seconds(self, marker) -> float:
        if isinstance(marker, float):
            pc = marker
        else:
            marker.synchronize()
            pc = self._ref_pc + self._ref_event.elapsed_time(marker) / 1e3
        return self.origin_wall + (pc - self.origin_pc) - self.clock_offset

    # --- recording ---------------------------------------------------------------------------
    def add(self, name: str, cat: str, start, end=None, **args) -> dict:
        """Record a span; `end` may be filled in later (asynchronous work)."""
        event = {"name": name, "cat": cat, "phase": _phase, "start": start, "end": end, "args": args}
        if self.enabled:
            self.events.append(event)
        return event

    def metric(self, name: str, value, step: int | None = None) -> None:
        """Note a number (or a small JSON-able value) against a step: a loss, an expert's load."""
        if self.enabled:
            self.metrics.append({"name": name, "step": step, "value": value})

    def sample(self, step: int | None = None, **categories) -> None:
        """Note measured memory (bytes per category) at this moment, labelled with the phase."""
        if self.enabled:
            self.samples.append({"time": time.perf_counter(), "phase": _phase, "step": step, **categories})

    def open(self, name: str, cat: str = "compute", **args) -> dict:
        """Start a span now; `close` ends it. For spans that begin in one hook and end in another."""
        event = self.add(name, cat, self.mark(), **args)
        for listener in self.listeners:
            listener("open", event)
        return event

    def close(self, event: dict) -> None:
        event["end"] = self.mark()
        for listener in self.listeners:
            listener("close", event)

    @contextlib.contextmanager
    def span(self, name: str, cat: str = "compute", **args):
        """Time a block of work on this rank (on a GPU: the device's time, not the host's)."""
        event = self.open(name, cat, **args)
        try:
            yield event
        finally:
            self.close(event)

    @contextlib.contextmanager
    def listening(self, listener):
        """Call `listener(kind, event)` when a span opens or closes, for the block (the simulator cuts a
        step's program at the strategies' own spans, so its timeline has the spans a real trace has)."""
        self.listeners.append(listener)
        try:
            yield
        finally:
            self.listeners.remove(listener)

    def finish(self, rank: int) -> tuple[list[dict], list[dict], list[dict]]:
        """Resolve every marker to aligned seconds; return (events, samples, metrics) tagged with `rank`."""
        events = []
        for e in self.events:
            end = e["end"] if e["end"] is not None else e["start"]
            events.append(
                {
                    "name": e["name"],
                    "cat": e["cat"],
                    "phase": e["phase"],
                    "rank": rank,
                    "start": self._seconds(e["start"]),
                    "end": self._seconds(end),
                    "args": e["args"],
                }
            )
        samples = [dict(s, rank=rank, time=self._seconds(s["time"])) for s in self.samples]
        metrics = [dict(m, rank=rank) for m in self.metrics]
        return events, samples, metrics


def align(recorder: Recorder, rounds: int = 5) -> float:
    """Estimate this rank's clock offset to rank 0: barrier, read the clock, gather, median.

    Barrier exits are close to simultaneous (tens of microseconds on one host), which bounds the
    error; the median of a few rounds discards an unlucky one. Uses raw torch.distributed on purpose:
    bookkeeping collectives are not part of the story a trace tells.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        recorder.clock_offset = 0.0
        return 0.0
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    samples = []
    for _ in range(rounds):
        dist.barrier()
        now = torch.tensor([time.time()], dtype=torch.float64, device=device)
        everyone = [torch.empty_like(now) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, now)
        samples.append((now - everyone[0]).item())
    recorder.clock_offset = statistics.median(samples)
    return recorder.clock_offset


recorder = Recorder()
span = recorder.span
