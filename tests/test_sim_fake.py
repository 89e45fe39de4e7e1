"""torch's fake process group is private API: what the simulator relies on, pinned (toolkit/sim/fake.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import toolkit
from toolkit.sim import cluster as sim_cluster
from toolkit.sim import fake


def test_a_fake_group_of_1024_ranks_with_subgroups_on_meta_tensors():
    fake.init(1024, rank=9)
    try:
        assert fake.is_fake() and dist.get_world_size() == 1024 and dist.get_rank() == 9
        node = dist.new_group(list(range(8, 16)))  # HSDP's shard group of this rank's node
        across = dist.new_group(list(range(1, 1024, 8)))  # its replica group across nodes
        assert dist.get_process_group_ranks(across)[:3] == [1, 9, 17]
        shard = torch.empty(1000, device="meta")
        for group, n in ((None, 1024), (node, 8), (across, 128)):
            full = torch.empty(n * 1000, device="meta")
            dist.all_gather_into_tensor(full, shard, group=group)
            dist.reduce_scatter_tensor(shard, full, group=group, async_op=True).wait()
            dist.all_reduce(shard, group=group)
            dist.all_to_all_single(torch.empty(n * 4, device="meta"), torch.empty(n * 4, device="meta"), group=group)
        x = torch.ones(4)  # on real tensors, values are not exchanged: every collective leaves them as they are
        dist.all_reduce(x)
        assert x.tolist() == [1.0] * 4
        storage = full.untyped_storage()  # how sharded strategies free and refill a unit, on meta
        storage.resize_(0)
        assert storage.nbytes() == 0
        storage.resize_(8 * 4000)
        assert full.untyped_storage().nbytes() == 8 * 4000
    finally:
        dist.destroy_process_group()


def test_the_cluster_is_torn_down_on_error():
    """(tests/test_sim_vs_real.py then launches real ranks from the same process.)"""
    with pytest.raises(RuntimeError, match="boom"):
        with sim_cluster.cluster(512, rank=3):
            assert toolkit.runtime.env.device() == torch.device("meta")
            toolkit.comm.group_ranks()  # fills the ranks cache with the fake world
            raise RuntimeError("boom")
    assert not dist.is_initialized() and toolkit.runtime.env.device() == torch.device("cpu")
    assert not toolkit.comm.collectives._ranks_cache


def test_inside_a_process_group_a_simulation_says_what_to_do():
    fake.init(2, rank=0)
    try:
        with pytest.raises(RuntimeError, match="already initialized"):
            with sim_cluster.cluster(8):
                pass
    finally:
        dist.destroy_process_group()
