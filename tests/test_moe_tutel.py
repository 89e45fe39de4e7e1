"""Issue 15, the MoE half: the link's physics, Tutel complete (2DH, EP+DP+MP, dynamic capacity), and the layering.

- Layering: no file of toolkit/moe imports the layer back (the layer sits on top of its parts).
"""
from __future__ import annotations

import ast
import pathlib
import time

import pytest

import toolkit
from toolkit.comm import emulate

MOE = pathlib.Path(toolkit.__file__).parent / "moe"
BANDWIDTH, LATENCY = 10e6, 1e-3


def test_no_part_of_the_moe_package_imports_the_layer_back():
    for path in sorted(MOE.glob("*.py")):
        if path.name in ("__init__.py", "layer.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.module not in ("layer", "toolkit.moe.layer") and not (
                    node.level == 1 and node.module == "layer"), (
                    f"{path.name} imports from the layer (line {node.lineno}): the layer is built on its parts, "
                    f"so what they need from it belongs in a lower file (moe/plan.py, moe/load.py).")


# --- the link's physics: what a rank sends AND receives, the node's shared card ------------------------
def test_an_all_to_all_is_timed_by_what_a_rank_receives_too():
    from toolkit.comm.emulate import make_settings, model_time

    one = make_settings(BANDWIDTH, LATENCY)
    nothing_out = dict(input_splits=[0, 0, 0, 0], output_splits=[10, 10, 0, 10], row_bytes=(100, 100))
    seconds, _ = model_time(one, "all_to_all", [0, 1, 2, 3], 2, 0, nothing_out)   # sends nothing at all
    assert seconds == pytest.approx(3 * LATENCY + 3000 / BANDWIDTH)
    rows_differ = dict(input_splits=[1, 1, 1, 1], output_splits=[1, 1, 1, 1], row_bytes=(100, 400))
    assert model_time(one, "all_to_all", [0, 1, 2, 3], 0, 400, rows_differ)[0] == pytest.approx(
        3 * LATENCY + 1200 / BANDWIDTH)


def test_the_ranks_of_a_node_share_its_card():
    """Two ranks of one node each push 1 MB to the other node at 100 MB/s: together at least 20 ms."""
    from toolkit.comm.cost import demand, together
    from toolkit.comm.emulate import book, make_settings

    nodes = make_settings(100e6, "1 us", ranks_per_node=2)
    push = {0: demand(nodes, "send", [0, 2], 0, 1e6, dict(peer=2)), 1: demand(nodes, "send", [1, 3], 1, 1e6, dict(peer=3))}
    assert push[0].alone == pytest.approx(0.01 + 1e-6) and together(nodes, push) == pytest.approx(0.02 + 1e-6)
    apart = make_settings(100e6, "1 us")  # one rank per node: every rank has its own card
    assert together(apart, {0: demand(apart, "send", [0, 2], 0, 1e6, dict(peer=2)),
                            1: demand(apart, "send", [1, 3], 1, 1e6, dict(peer=3))}) == pytest.approx(0.01 + 1e-6)
    # a ring crosses each node boundary once: one all-reduce over 2 nodes does not congest a card;
    # two in parallel groups ({0, 2} and {1, 3}, HSDP's replicas) do
    ring = {r: demand(nodes, "all_reduce", [0, 1, 2, 3], r, 1e6) for r in range(4)}
    assert together(nodes, ring) == pytest.approx(ring[1].alone)
    pairs = {r: demand(nodes, "all_reduce", [r % 2, r % 2 + 2], r, 1e6) for r in range(4)}
    assert together(nodes, pairs) == pytest.approx(2 * 0.01 + 2e-6)  # the bytes in turn; latency is not shared
    with emulate(100e6, "1 us", ranks_per_node=2):  # the emulator's own booking, two ranks of node 0
        start = time.perf_counter()
        first, _ = book("send", [0, 2], 0, 1e6, dict(peer=2))
        second, args = book("send", [1, 3], 1, 1e6, dict(peer=3))
    assert second - start >= 0.02 and args["emulated_s"] == pytest.approx(0.01 + 1e-6)
    assert args["emulated_queue_s"] >= 0.01 - (time.perf_counter() - start)


def test_auto_placement_prices_the_popular_experts_owner_by_what_it_receives():
    """W = E = 4, every rank routes [90, 4, 3, 3]: rank 0 receives 270 rows, the others send 97 each.
    Priced by the rows a rank sends (97) expert parallelism looked cheaper; by the busiest rank's
    receive (270) moving the weights is."""
    from toolkit.moe.placement import choose_parallel, expert_parameters, parallel_costs
    from toolkit.moe.sharded import row_destinations

    counts = [[90, 4, 3, 3]] * 4
    traffic = [row_destinations(c, 4, 4) for c in counts]
    P = expert_parameters(32, 64, 4)
    costs = parallel_costs(traffic, expert_params=P, d_model=32)
    assert costs["busiest"] == 0 and costs["busiest_rows"] == 270
    assert costs["ep_s"] == pytest.approx(4 * 270 * 32 * 4) and costs["dp_s"] == pytest.approx(1.5 * P * 4)
    assert choose_parallel(costs, num_experts=4, expert_params=P)[0] == "dp"
    link = toolkit.comm.emulate(1e9, "1 ms")  # a slow-latency link: each all-to-all pays 3 ms, a ring 3 ms
    with link:
        timed = parallel_costs(traffic, expert_params=P, d_model=32, settings=link.settings)
    assert timed["ep_s"] == pytest.approx(4 * (3e-3 + 270 * 128 / 1e9))
    assert timed["dp_s"] == pytest.approx(2 * (3e-3 + 0.75 * P * 4 / 1e9))


def test_2dh_crossover_on_the_model():
    """8 ranks per node, 64 MB per rank: on few nodes the flat all-to-all wins (2DH pays an extra pass inside
    the node); as nodes grow its W-8 cross-node messages per rank lose to 2DH's nodes-1 larger ones. The
    crossover: 2DH saves (G-1)(N-1) latencies and pays (G-1)/G * S * (N-1)/N more bytes inside the node, so it
    wins from N = S / (G * alpha * B_intra) = 64 MB / (8 * 5 us * 150 GB/s) = 10.7 nodes."""
    from toolkit.comm.emulate import make_settings
    from toolkit.comm.hierarchical import predicted_times

    link = make_settings("100 Gb/s", "5 us", intra_node=("150 GB/s", "2 us"), ranks_per_node=8)
    S = 64e6
    times = {n: predicted_times(link, n, 8, S) for n in (2, 8, 12, 32)}
    assert times[2]["flat"] < times[2]["2dh"] and times[8]["flat"] < times[8]["2dh"]
    assert times[12]["2dh"] < times[12]["flat"] and times[32]["2dh"] < times[32]["flat"]
    assert (times[2]["messages flat"], times[2]["messages 2dh"]) == (15, 8) and times[32]["messages 2dh"] == 7 + 31
    # the bytes that cross nodes are the same, queued on the card by its 8 ranks; 2DH's cross-node phase on
    # 32 nodes: 8 x 31/32 x S on the card, then 31 latencies
    assert times[32]["2dh inter"] == pytest.approx(8 * 31 / 32 * S / 12.5e9 + 31 * 5e-6)
