"""How late a collective's last rank comes, measured on this machine (`Cluster.late_peers`).

The ranks compute the same work between two calls, yet on shared cores they finish it at different moments, and a
collective starts when its last rank arrives. Each rank notes when it issues each call; the mean over calls and
ranks of (the last issue - its own), for a spread of compute between calls. An emulated link's time runs from that
last issue (`toolkit.comm.emulate`; timeline rule 7).
"""

from __future__ import annotations

import time

LATE_GAPS = (0, 10, 30, 100, 300)  # 128x128 matmuls between two calls: about 0 to 30 ms a round at 4 ranks on 2 cores
LATE_CALLS = 30


def matmuls():
    """The calibration's unit of compute between two calls: a 128 x 128 product (`calibrate_links` uses it too)."""
    import torch

    return torch.randn(128, 128), torch.randn(128, 128)


def late_peers() -> list:
    """[(compute seconds, lateness seconds)] for each of LATE_GAPS, every rank at once: the compute a rank ran between
    the end of one small all-reduce and its next call (the median over calls and ranks), and how long after a rank's
    own issue the last rank issued the same call (the mean over calls and ranks; the loop's first call left out).
    Ranks that share cores finish the same work apart: at 4 ranks on 2 cores the last one comes about a fifth of the
    compute later, at most a few milliseconds (the scheduler's slices); at 2 ranks, a few percent."""
    import torch
    import torch.distributed as dist

    a, b = matmuls()
    token, found = torch.zeros(1), []
    for gap in LATE_GAPS:
        issued, ended = [], []
        dist.barrier()
        ended.append(time.perf_counter())
        for _ in range(LATE_CALLS):
            for _ in range(gap):
                a @ b
            issued.append(time.perf_counter())
            dist.all_reduce(token)
            ended.append(time.perf_counter())
        marks = torch.tensor([issued, ended[:-1]], dtype=torch.float64)
        every = [torch.zeros_like(marks) for _ in range(dist.get_world_size())]
        dist.all_gather(every, marks)
        issues = torch.stack([e[0] for e in every])  # ranks x calls
        compute = torch.stack([e[0] - e[1] for e in every])
        late = (issues.max(0).values - issues)[:, 1:]
        found.append((compute[:, 1:].median().item(), late.mean().item()))
    return sorted(found)
