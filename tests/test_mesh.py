"""The dp x pp x tp layout: tensor-parallel ranks consecutive, sizes checked before any group is made."""
import pytest
import torch.distributed as dist

import toolkit
from toolkit.parallel import mesh


def test_tensor_parallel_ranks_are_consecutive_and_dp_is_slowest():
    shape = mesh.Layout(dp=2, pp=2, tp=2)
    assert [shape.coordinate(r) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert all(shape.rank(*shape.coordinate(r)) == r for r in range(8))


def test_a_world_that_does_not_split_is_refused_with_the_sizes_that_would():
    with pytest.raises(ValueError, match=r"does not split into pp=1 x tp=4.*one of \[1, 2, 3, 6\]"):
        mesh.layout(6, tp=4)
    with pytest.raises(ValueError, match="tp must be a positive int"):
        mesh.layout(4, tp=0)
    assert mesh.layout(12, tp=2, pp=3) == mesh.Layout(dp=2, pp=3, tp=2)


def _groups():
    m = mesh.build(tp=2)
    return (mesh.layout_of(m), tuple(m.get_coordinate()),
            dist.get_process_group_ranks(mesh.group(m, "tp")), dist.get_process_group_ranks(mesh.group(m, "dp")))


@pytest.mark.timeout(120)
def test_the_mesh_is_torchs_device_mesh_with_the_three_names():
    got = toolkit.launch(_groups, 4, timeout_s=90)
    assert [g[0] for g in got] == [mesh.Layout(dp=2, pp=1, tp=2)] * 4
    assert [g[1] for g in got] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]
    assert [g[2] for g in got] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g[3] for g in got] == [[0, 2], [1, 3], [0, 2], [1, 3]]
