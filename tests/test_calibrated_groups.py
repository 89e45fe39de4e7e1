"""This machine's collectives in a group smaller than the world are measured, not read off the world's fit: the
layouts' tensor-, pipeline- and data-parallel groups run their collectives while the other groups run theirs, on the
same shared cores, so a pair of ranks at world 4 costs more than the alpha-beta fitted on all 4 gives 2 ranks
(measured 1.2x-2.0x on 2 cores, `calibrate_links.subgroups`). The calibration measures every group size that divides
the world, in blocks, all at once; the cost model prices a group's collective on its size's measurement."""

import pytest
from test_sim_cost import calibration

import toolkit
from toolkit.sim.calibrate import from_measurements
from toolkit.sim.calibrate_links import measure_links, subgroups
from toolkit.sim.collective_time import collective_time

WORLD = {"bandwidth": 1e9, "latency": 1e-3}
PAIRS = {"bandwidth": 0.5e9, "latency": 2e-3}


def machine(**changes):
    links = {op: WORLD for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")}
    return from_measurements(calibration(links=links, world_size=4, **changes))


def test_a_groups_collective_is_priced_on_what_was_measured_for_its_size():
    pairs = machine(group_links={"2": {"all_reduce": PAIRS, "all_to_all": PAIRS}})
    size = 1e6
    # the ring's 2(n-1) steps of alpha and 2(n-1)/n of the message: n = 2 on the pairs' link, n = 4 on the world's
    assert collective_time(pairs, "all_reduce", size, [0, 1]).seconds == pytest.approx(2 * 2e-3 + size / 0.5e9)
    assert collective_time(pairs, "all_reduce", size, [0, 1, 2, 3]).seconds == pytest.approx(
        6 * 1e-3 + 1.5 * size / 1e9
    )
    world_only = machine()  # a calibration without groups (or a size not measured) prices on the world's fit
    assert collective_time(world_only, "all_reduce", size, [0, 1]).seconds == pytest.approx(2 * 1e-3 + size / 1e9)
    assert collective_time(pairs, "all_gather", size, [0, 1]).seconds == pytest.approx(1e-3 + 0.5 * size / 1e9)
    # the pairwise exchange: one peer's latency, then half of the message to it at the pairs' rate
    assert collective_time(pairs, "all_to_all", size, [2, 3], me=2).seconds == pytest.approx(2e-3 + 0.5 * size / 0.5e9)
    assert collective_time(world_only, "all_to_all", size, [2, 3], me=2).seconds == pytest.approx(
        1e-3 + 0.5 * size / 1e9
    )


def _measured_groups(ops, sizes):
    import torch.distributed as dist

    return [(k, dist.get_process_group_ranks(g)) for k, g in subgroups(dist.get_world_size())], measure_links(
        ops, sizes
    )["records"]


@pytest.mark.timeout(180)
def test_the_calibration_measures_each_group_size_in_blocks_all_at_once(no_leftover_ranks):
    results = toolkit.launch(_measured_groups, 4, args=(("all_reduce",), (4096, 65536)), timeout_s=150, quiet=True)
    assert [groups for groups, _ in results] == [[(2, [0, 1])], [(2, [0, 1])], [(2, [2, 3])], [(2, [2, 3])]]
    records = results[0][1]
    assert sorted((r["world_size"], r["size_bytes"]) for r in records) == [(2, 4096), (2, 65536), (4, 4096), (4, 65536)]
    assert all(r["seconds"] >= 0 for r in records)
