"""Where a priced step's time goes, part by part, adding up to the step.

The compute stream of the priced rank is busy or waiting at every moment of the step. Busy, it runs:

- "gemm", "attention", "memory_bound": its kernels' device seconds by kind (`kernel_time.segment_parts`; a fused
  attention is "attention", an unfused one its GEMMs and memory-bound kernels);
- "optimizer": every kernel of the optimizer's step;
- "overhead": the host's launches where they were longer than the kernels (on a CPU: all of them);
- "contention": how much longer compute ran beside collectives in flight (the overlap rule's rule 6);
- "roofline": compute priced as one roofline (a hand-written program, or `mfu=`), when there is any.

Waiting, it is "exposed_comm" (its own collectives), and in a pipeline "bubble" (another stage's compute) and
"p2p" (a transfer on the wire). Those parts add up to "step"; "compute" is the busy ones together, and
"overlapped_comm" (collectives hidden behind compute) is said beside, not added.
"""

from __future__ import annotations

from ..units import seconds_text
from .kernel_time import segment_parts

BUSY = ("gemm", "attention", "memory_bound", "optimizer", "overhead", "contention")
WAITING = ("exposed_comm", "bubble", "p2p")
NAMES = {
    "gemm": "GEMM",
    "attention": "attention",
    "memory_bound": "memory-bound",
    "optimizer": "optimizer",
    "overhead": "launch overhead",
    "contention": "compute slowed beside collectives",
    "roofline": "roofline",
    "exposed_comm": "exposed communication",
    "bubble": "bubble",
    "p2p": "point-to-point",
}


def busy_parts(spans, gpu, roofline: bool, cache: dict | None = None) -> dict:
    """Seconds of the compute spans by part (the BUSY ones, and "roofline" where compute was priced as one)."""
    out = dict.fromkeys(BUSY, 0.0)
    for s in spans:
        if s.kind == "host":  # a CPU's collective run on the cores: the rank waits for its communication
            continue
        if s.kind != "compute":
            continue
        segment, nominal = s.instruction, s.end - s.start - s.contention
        out["contention"] += s.contention
        if roofline or not (segment.kernels or segment.views_only):
            out["roofline"] = out.get("roofline", 0.0) + nominal
            continue
        parts = segment_parts(segment, gpu, cache)
        device = sum(parts.values())
        if segment.phase == "optimizer":
            out["optimizer"] += device
        else:
            for kind, seconds in parts.items():
                out[kind] += seconds
        out["overhead"] += nominal - device
    return out


def step_breakdown(spans, waits: dict, overlapped: float, gpu, roofline: bool, cache: dict | None = None) -> dict:
    """The parts of a step (see the module doc): busy parts from `spans`, waiting parts from `waits` (a timeline's
    or a pipeline stage's breakdown, which says the step and its exposed communication, bubble and transfers)."""
    out = busy_parts(spans, gpu, roofline, cache)
    out.update({k: max(waits.get(k, 0.0), 0.0) for k in WAITING if k in waits})
    out["compute"] = sum(v for k, v in out.items() if k not in WAITING)
    out.update(overlapped_comm=overlapped, step=waits["step"])
    return out


def text(b: dict) -> str:
    """ "step 3.53 s = GEMM 2.10 s + attention 0.41 s + ..." with every part there is, in the module's order."""
    order = [k for k in (*BUSY, "roofline", *WAITING) if b.get(k, 0.0) > 0]
    return f"step {seconds_text(b['step'])} = " + " + ".join(f"{NAMES[k]} {seconds_text(b[k])}" for k in order)
