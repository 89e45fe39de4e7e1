"""Lab 10: what a training step costs, the alpha-beta model and the overlap rule, written by you.

Four pure functions are yours: the alpha-beta time of the ring's three collectives, and the overlap
rule that turns a recorded step (a program: compute and collectives in the order the strategy issued
them) into a step time. No process group, no tensors: numbers in, numbers out. Read README.md first,
then grade your work with

    python -m toolkit grade labs/10-cost-model                     # grades this file
    python -m toolkit grade labs/10-cost-model --solution my.py    # or a copy of it

Notation: N ranks in the group, alpha = seconds per message (one step of the ring), beta = seconds per
byte (1 / bandwidth). `size_bytes` is the whole buffer: the tensor of an all-reduce, the input of a
reduce-scatter, the gathered output of an all-gather.
"""

from __future__ import annotations

from toolkit.sim.program import Collective, Compute, Wait  # noqa: F401 - the three kinds of instruction


# --- yours: 1. the ring's three collectives ------------------------------------------------------------
def reduce_scatter_time(size_bytes: float, n: int, alpha: float, beta: float) -> float:
    """Seconds for a ring reduce-scatter of `size_bytes` (the whole input) over `n` ranks, in the alpha-beta model:
    every message costs alpha plus its bytes times beta (README, "1. The ring's three collectives"; lab 01 is the
    ring). A group of one rank moves nothing: 0 seconds.
    """
    raise NotImplementedError("reduce_scatter_time: not written yet")


def all_gather_time(size_bytes: float, n: int, alpha: float, beta: float) -> float:
    """Seconds for a ring all-gather whose gathered output is `size_bytes`, over `n` ranks."""
    raise NotImplementedError("all_gather_time: not written yet")


def all_reduce_time(size_bytes: float, n: int, alpha: float, beta: float) -> float:
    """Seconds for a ring all-reduce of a `size_bytes` tensor over `n` ranks."""
    raise NotImplementedError("all_reduce_time: not written yet")


# --- yours: 2. the overlap rule ----------------------------------------------------------------------------
def step_time(program, compute_seconds, comm_seconds) -> dict:
    """Replay a step on two streams; return {"step", "compute", "exposed_comm", "overlapped_comm"} in seconds.

    program: a list of `Compute`, `Collective` and `Wait`, in the order the strategy issued them. compute_seconds(c)
    and comm_seconds(c) say how long one Compute or one Collective takes.

    The rule (README, "2. The overlap rule"): a Compute runs on the compute stream after what ran there before; a
    Collective's data is ready when the compute issued before it is done, and it runs on the one communication
    stream from then, or once the collective before it has ended; a Wait holds the compute stream until its
    collective has ended; the step ends when both streams are done. compute is the sum of the compute times,
    exposed_comm = step - compute, overlapped_comm = the total communication time minus exposed_comm (the
    communication that hid behind computation).
    """
    raise NotImplementedError("step_time: not written yet")
