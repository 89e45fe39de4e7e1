"""torch's fake process group, pinned in one place: it is private API and changes between releases.

`torch.testing._internal.distributed.fake_pg` registers a "fake" backend: a process group of any size
in which this one process plays one rank, and every collective completes at once without moving data
(an all-gather copies the local input into every slot, a reduce-scatter copies this rank's chunk, an
all-to-all repeats the input's first block: shapes and allocations are right, values are not; `alike_all_to_all`
puts right the values a program decides by). Sub-groups work.
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

import contextlib

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


@contextlib.contextmanager
def alike_all_to_all():
    """The values of an all-to-all on a simulated rank, where it has values (not meta tensors: an MoE layer's counts,
    from which its experts' rows and its messages' sizes follow). The fake one copies the input's first block into
    every slot, so rank r would "receive" what it sends rank 0, and every rank would carry rank 0's load. Here each
    peer sends this rank what it sends itself: the simulator's assumption everywhere, every rank runs the same
    program (under an assumed routing, the same choice of experts). Blocks of another size are left as they are."""
    fake_all_to_all = dist.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        work = fake_all_to_all(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        if not (output.is_meta or input.is_meta):
            n, me = dist.get_world_size(group), dist.get_rank(group)
            mine = input.split(list(input_split_sizes or [input.shape[0] // n] * n))[me]
            for block in output.split(list(output_split_sizes or [output.shape[0] // n] * n)):
                if block.shape == mine.shape:
                    block.copy_(mine)
        return work

    dist.all_to_all_single = all_to_all_single
    try:
        yield
    finally:
        dist.all_to_all_single = fake_all_to_all
