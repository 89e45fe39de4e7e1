"""Lab 10: what a training step costs, the alpha-beta model and the overlap rule (the reference solution).

Four pure functions are yours: the alpha-beta time of the ring's three collectives, and the overlap
rule that turns a recorded step (a program: compute and collectives in the order the strategy issued
them) into a step time. No process group, no tensors: numbers in, numbers out. Read README.md first,
then grade your work with

    python -m toolkit grade labs/10-cost-model                     # grades skeleton.py
    python -m toolkit grade labs/10-cost-model --solution my.py    # or a copy of it

Notation: N ranks in the group, alpha = seconds per message (one step of the ring), beta = seconds per
byte (1 / bandwidth). `size_bytes` is the whole buffer: the tensor of an all-reduce, the input of a
reduce-scatter, the gathered output of an all-gather.
"""

from __future__ import annotations

from toolkit.sim.program import Collective, Compute, Wait


# --- yours: 1. the ring's three collectives ------------------------------------------------------------
def reduce_scatter_time(size_bytes: float, n: int, alpha: float, beta: float) -> float:
    """N-1 steps; at each, every rank sends one chunk of size_bytes / N to its neighbour."""
    if n <= 1:
        return 0.0
    return (n - 1) * (alpha + size_bytes / n * beta)


def all_gather_time(size_bytes: float, n: int, alpha: float, beta: float) -> float:
    """The reduce-scatter's steps run the other way: N-1 steps of one chunk each."""
    if n <= 1:
        return 0.0
    return (n - 1) * (alpha + size_bytes / n * beta)


def all_reduce_time(size_bytes: float, n: int, alpha: float, beta: float) -> float:
    """A reduce-scatter, then an all-gather of the reduced chunks: 2(N-1) steps, 2(N-1)/N of the buffer."""
    return reduce_scatter_time(size_bytes, n, alpha, beta) + all_gather_time(size_bytes, n, alpha, beta)


# --- yours: 2. the overlap rule ----------------------------------------------------------------------------
def step_time(program, compute_seconds, comm_seconds) -> dict:
    """Replay a step on two streams; return {"step", "compute", "exposed_comm", "overlapped_comm"} in seconds.

    program: a list of `Compute`, `Collective` and `Wait` in the order the strategy issued them.
    compute_seconds(c) and comm_seconds(c) say how long one Compute or one Collective takes.
    """
    clock = 0.0  # where the compute stream is
    link_free = 0.0  # when the communication stream is free again
    ends = {}  # collective id -> when it ends
    compute = comm = 0.0
    for instruction in program:
        if isinstance(instruction, Compute):
            seconds = compute_seconds(instruction)
            clock += seconds
            compute += seconds
        elif isinstance(instruction, Collective):
            start = max(clock, link_free)  # its data is ready now; the link may still be busy
            seconds = comm_seconds(instruction)
            link_free = ends[instruction.id] = start + seconds
            comm += seconds
        elif isinstance(instruction, Wait):
            clock = max(clock, ends[instruction.id])  # compute stalls until that collective is done
    step = max([clock] + list(ends.values()))
    exposed = step - compute
    return {"step": step, "compute": compute, "exposed_comm": exposed, "overlapped_comm": comm - exposed}
