"""The dp x pp x cp x tp layout: the rank order an option (Megatron's by default), groups by global rank, sizes
checked before any group is made."""

import pytest
import torch.distributed as dist

import toolkit
from toolkit.parallel import mesh


def test_megatrons_order_is_the_default_pp_outermost_tp_consecutive():
    shape = mesh.Layout(dp=2, pp=2, tp=2)
    assert shape.order == "tp-cp-ep-dp-pp" == mesh.ORDER
    assert [tuple(shape.coordinate(r)) for r in range(8)] == [  # (dp, pp, cp, tp)
        (0, 0, 0, 0),
        (0, 0, 0, 1),
        (1, 0, 0, 0),
        (1, 0, 0, 1),
        (0, 1, 0, 0),
        (0, 1, 0, 1),
        (1, 1, 0, 0),
        (1, 1, 0, 1),
    ]
    assert all(shape.rank(**shape.coordinate(r)._asdict()) == r for r in range(8))
    assert shape.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert shape.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]  # a pipeline's stages are the farthest apart


def test_dp_outermost_is_the_order_this_toolkit_had():
    shape = mesh.Layout(dp=2, pp=2, tp=2, order=mesh.DP_OUTERMOST)
    coordinates = [shape.coordinate(r) for r in range(8)]
    assert [(c.dp, c.pp, c.tp) for c in coordinates] == [
        (d, p, t) for d in range(2) for p in range(2) for t in range(2)
    ]
    assert shape.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert shape.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_cp_sits_between_tp_and_dp_and_flattens_with_dp():
    shape = mesh.layout(16, tp=2, cp=2, pp=2)  # dp 2
    assert shape.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert shape.groups("dp", "cp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert shape.group_of(5, "pp") == [5, 13]
    llama3 = mesh.Layout(dp=8, pp=16, cp=16, tp=8, order="tp-cp-pp-dp")  # Llama 3 at 128k: [tp, cp, pp, dp]
    assert llama3.world_size == 16384 and llama3.group_of(0, "cp")[:3] == [0, 8, 16]
    assert llama3.group_of(0, "pp")[:2] == [0, 128] and llama3.group_of(0, "dp")[:2] == [0, 2048]


def test_an_order_must_name_every_dimension_once():
    with pytest.raises(ValueError, match="must name each of .* once, innermost first"):
        mesh.layout(8, tp=2, order="tp-dp-pp")
    with pytest.raises(ValueError, match="must name each of"):
        mesh.Layout(order="tp-tp-dp-pp")
    assert mesh.nesting("tp-cp-ep-dp-pp") == ("tp", "cp", "dp", "pp")  # ep, Megatron's, takes no ranks here


def test_a_world_that_does_not_split_is_refused_with_the_sizes_that_would():
    with pytest.raises(ValueError, match=r"does not split into pp=1 x tp=4.*one of \[1, 2, 3, 6\]"):
        mesh.layout(6, tp=4)
    with pytest.raises(ValueError, match=r"pp=1 x cp=4 x tp=1 = 4 ranks"):
        mesh.layout(6, cp=4)
    with pytest.raises(ValueError, match="tp must be a positive int"):
        mesh.layout(4, tp=0)
    assert mesh.layout(12, tp=2, pp=3) == mesh.Layout(dp=2, pp=3, tp=2)


def _groups(order):
    m = mesh.build(tp=2, pp=2, order=order)
    ranks = dist.get_process_group_ranks
    return (
        mesh.layout_of(m),
        tuple(mesh.coordinate(m)),
        m.mesh_dim_names,
        {d: ranks(mesh.group(m, d)) for d in mesh.DIMS},
        ranks(mesh.group(m, "dp", "cp")),
    )


@pytest.mark.timeout(120)
def test_the_mesh_is_torchs_device_mesh_its_groups_those_of_the_layout():
    for order in (mesh.ORDER, mesh.DP_OUTERMOST):
        got = toolkit.launch(_groups, 8, args=(order,), timeout_s=90)
        shape = mesh.layout(8, tp=2, pp=2, order=order)
        assert [g[0] for g in got] == [shape] * 8
        assert [g[1] for g in got] == [tuple(shape.coordinate(r)) for r in range(8)]
        assert {g[2] for g in got} == {("dp", "pp", "cp", "tp")}
        for r, g in enumerate(got):
            assert g[3] == {d: shape.group_of(r, d) for d in mesh.DIMS}
            assert g[4] == shape.group_of(r, "dp")  # dp x cp with cp = 1 is dp's own group


def test_the_simulator_runs_whichever_order_is_chosen_on_the_real_groups():
    """The simulated rank's collectives name the global ranks of its groups in the order asked for (the pricing
    reads them: which groups cross nodes), and its pipeline is the layout's."""
    from toolkit.models import tiny_gpt
    from toolkit.sim import simulate
    from toolkit.sim.pipelined import pipeline_of

    for order in (mesh.ORDER, mesh.DP_OUTERMOST):
        shape = mesh.layout(8, tp=2, pp=2, order=order)
        sim = simulate(
            lambda: tiny_gpt(n_layer=2), "ddp", 8, rank=1, tp=2, pp=2, order=order, batch_per_rank=2, progress=False
        )
        groups = {c.group for c in sim.collectives() if c.op == "all_reduce" and c.phase == "backward"}
        assert tuple(shape.group_of(1, "dp")) in groups and tuple(shape.group_of(1, "tp")) in groups, (order, groups)
        assert pipeline_of(8, 1, dict(tp=2, pp=2, order=order)) == shape.group_of(1, "pp")
