"""torch's fake process group, pinned in one place: it is private API and changes between releases.

`torch.testing._internal.distributed.fake_pg` registers a "fake" backend: a process group of any size
in which this one process plays one rank, and every collective completes at once without moving data
(an all-gather copies the local input into every slot, a reduce-scatter copies this rank's chunk, an
all-to-all repeats the input: shapes and allocations are right, values are not). Sub-groups work.
Checked with torch 2.13 (tests/test_sim_fake.py); if a release moves it, this is the file to change.

How large a world: one rank's program (its tensors, operations and messages) depends on the sizes of its groups and
where their members sit, not on how many ranks there are; what grows with the world is the groups themselves. A
dp x pp x cp x tp layout is a torch `DeviceMesh`, which makes every group of every dimension on every rank (about
1.4 x world `new_group` calls, each keeping its members' ranks): a small GPT's rank simulates in 0.5 s at 4,096 and
at 16,384 ranks, 0.9 s at 65,536, its process 5 and 17 MB larger (bench/long_context.py --part worlds). 65,536
covers the largest published runs (Llama 3's 16,384 H100); tests/test_sim_scale.py holds a rank's program at 16,384
to the same rank's at 4,096.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

BACKEND = "fake"
MAX_WORLD_SIZE = 65536  # what the toolkit promises (and tests); the fake group itself has no limit


def _completes_at_once() -> None:
    """A fake collective is complete as soon as it is issued (its result, shapes only, is in place), but torch's
    FakeWork answers `is_completed()` with False forever: code that lets go of finished work as it goes (the
    pipeline's mailbox, of the activations it has sent) would hold all of it to the step's end, which no real
    run does. Here it answers True."""
    work = getattr(torch._C._distributed_c10d, "FakeWork", None)
    if work is not None:
        work.is_completed = lambda self: True


def store():
    """The fake key-value store `init_process_group` wants (it stores nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    return FakeStore()


def init(world_size: int, rank: int) -> None:
    """Make this process rank `rank` of a fake default group of `world_size` ranks."""
    _completes_at_once()
    dist.init_process_group(BACKEND, store=store(), rank=rank, world_size=world_size)


def is_fake() -> bool:
    """True when the default group is a fake one (the simulator's own check; strategies never ask)."""
    return dist.is_initialized() and dist.get_backend() == BACKEND
