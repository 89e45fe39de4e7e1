"""What the launches of tests/test_model_parallel.py check on every rank, one function per behaviour, each
returning plain values that the test asserts (the launch runs them all, once)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def cross_entropy_backward_memory(tokens: int = 256, width: int = 512, hidden: int = 8) -> tuple[int, int]:
    """(bytes the vocabulary-parallel loss's backward allocates at its peak, through the head's matmul, measured by
    torch's MemTracker; one (tokens, V/t) fp32 buffer's bytes). The softmax the forward saved becomes the
    gradient in place, so backward allocates only the matmul's small gradients: well under one buffer."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from toolkit.parallel import mesh as mesh_
    from toolkit.parallel.tensor import TPGroup
    from toolkit.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy

    tp = TPGroup.of(dist.group.WORLD)
    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, requires_grad=True)
    head = torch.randn(width, hidden, requires_grad=True)
    y = torch.randint(0, width * tp.size, (tokens,))
    tracker = MemTracker()
    with tracker:  # watching from the forward on, so that the saved softmax is known before backward writes into it
        loss = vocab_parallel_cross_entropy(F.linear(h, head), y, tp)
    with tracker:  # entering again starts the peak from what is live now
        before = _total(tracker.get_tracker_snapshot("current"))
        loss.backward()
        peak = _total(tracker.get_tracker_snapshot("peak"))
    return peak - before, tokens * width * 4


def _total(snapshot: dict) -> int:
    return sum(v["Total"] for v in snapshot.values())
