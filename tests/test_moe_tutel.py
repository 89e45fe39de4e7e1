"""Issue 15, the MoE half: the link's physics, Tutel complete (2DH, EP+DP+MP, dynamic capacity), and the layering.

- Layering: no file of toolkit/moe imports the layer back (the layer sits on top of its parts).
"""

from __future__ import annotations

import ast
import functools
import math
import pathlib
import time
import zlib

import pytest
import torch

import toolkit
from toolkit.comm import emulate

MOE = pathlib.Path(toolkit.__file__).parent / "moe"
BANDWIDTH, LATENCY = 10e6, 1e-3


def test_no_part_of_the_moe_package_imports_the_layer_back():
    for path in sorted(MOE.glob("*.py")):
        if path.name in ("__init__.py", "layer.py", "hf.py"):  # hf.py is built on the layer (a Hugging Face
            continue  # model's experts made into one), not a part of it
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.module not in ("layer", "toolkit.moe.layer") and not (
                    node.level == 1 and node.module == "layer"
                ), (
                    f"{path.name} imports from the layer (line {node.lineno}): the layer is built on its parts, "
                    f"so what they need from it belongs in a lower file (moe/plan.py, moe/load.py)."
                )


# --- the link's physics: what a rank sends AND receives, the node's shared card ------------------------
def test_an_all_to_all_is_timed_by_what_a_rank_receives_too():
    from toolkit.comm.emulate import make_settings, model_time

    one = make_settings(BANDWIDTH, LATENCY)
    nothing_out = dict(input_splits=[0, 0, 0, 0], output_splits=[10, 10, 0, 10], row_bytes=(100, 100))
    seconds, _ = model_time(one, "all_to_all", [0, 1, 2, 3], 2, 0, nothing_out)  # sends nothing at all
    assert seconds == pytest.approx(3 * LATENCY + 3000 / BANDWIDTH)
    rows_differ = dict(input_splits=[1, 1, 1, 1], output_splits=[1, 1, 1, 1], row_bytes=(100, 400))
    assert model_time(one, "all_to_all", [0, 1, 2, 3], 0, 400, rows_differ)[0] == pytest.approx(
        3 * LATENCY + 1200 / BANDWIDTH
    )


def test_the_ranks_of_a_node_share_its_card():
    """Two ranks of one node each push 1 MB to the other node at 100 MB/s: together at least 20 ms."""
    from toolkit.comm.cost import demand, together
    from toolkit.comm.emulate import book, make_settings

    nodes = make_settings(100e6, "1 us", ranks_per_node=2)
    push = {
        0: demand(nodes, "send", [0, 2], 0, 1e6, dict(peer=2)),
        1: demand(nodes, "send", [1, 3], 1, 1e6, dict(peer=3)),
    }
    assert push[0].alone == pytest.approx(0.01 + 1e-6) and together(nodes, push) == pytest.approx(0.02 + 1e-6)
    free = make_settings(100e6, "1 us", ranks_per_node=2, shared_card=False)  # same nodes, a card per rank
    assert together(
        free, {r: demand(free, "send", [r, r + 2], r, 1e6, dict(peer=r + 2)) for r in (0, 1)}
    ) == pytest.approx(0.01 + 1e-6)
    apart = make_settings(100e6, "1 us")  # one rank per node: every rank has its own card
    assert together(
        apart,
        {
            0: demand(apart, "send", [0, 2], 0, 1e6, dict(peer=2)),
            1: demand(apart, "send", [1, 3], 1, 1e6, dict(peer=3)),
        },
    ) == pytest.approx(0.01 + 1e-6)
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
    crossover: the flat all-to-all's intra-node part runs beside its cross-node part, so it costs the cross-node
    part, (W-G) alpha + the card's bytes; 2DH pays its whole pass inside the node, (G-1)(alpha_intra + S/(G B_intra)),
    and (N-1) alpha + the same card bytes. It wins once (N-1) alpha > alpha_intra + S/(G B_intra), from
    N = 1 + (2 us + 64 MB / (8 x 150 GB/s)) / 5 us = 12.1 nodes."""
    from toolkit.comm.emulate import make_settings
    from toolkit.comm.hierarchical import predicted_times

    link = make_settings("100 Gb/s", "5 us", intra_node=("150 GB/s", "2 us"), ranks_per_node=8)
    S = 64e6
    times = {n: predicted_times(link, n, 8, S) for n in (2, 8, 12, 13, 32)}
    assert times[2]["flat"] < times[2]["2dh"] and times[8]["flat"] < times[8]["2dh"]
    assert times[12]["flat"] < times[12]["2dh"]
    assert times[13]["2dh"] < times[13]["flat"] and times[32]["2dh"] < times[32]["flat"]
    assert (times[2]["messages flat"], times[2]["messages 2dh"]) == (15, 8) and times[32]["messages 2dh"] == 7 + 31
    # the bytes that cross nodes are the same, queued on the card by its 8 ranks; 2DH's cross-node phase on
    # 32 nodes: 8 x 31/32 x S on the card, then 31 latencies
    assert times[32]["2dh inter"] == pytest.approx(8 * 31 / 32 * S / 12.5e9 + 31 * 5e-6)


# --- one launch of 4 ranks (2 nodes of 2) runs every multi-rank check ----------------------------------
D, FF, SEED, INIT = 8, 16, 5, 0.3
LAYOUTS = {  # W = 4 ranks; E < W slices each expert over W/E ranks (Tutel's EP+DP+MP, r = expert_slices)
    "E=2, r=2 (EP+MP)": dict(num_experts=2),
    "E=2, r=1 (EP+DP)": dict(num_experts=2, expert_slices=1),
    "E=1, r=2 (EP+DP+MP)": dict(num_experts=1, top_k=1, expert_slices=2),
    "E=2, r=2, 2DH": dict(num_experts=2, all_to_all_algorithm="2dh", node_size=2),
    "E=2, dp": dict(num_experts=2, expert_parallel="dp"),
    "E=8, 2DH": dict(num_experts=8, all_to_all_algorithm="2dh", node_size=2),
    "E=2, auto": dict(num_experts=2, expert_parallel="auto"),  # dp or ep, and r, chosen per forward
    "E=8, all-to-all auto": dict(num_experts=8, all_to_all_algorithm="auto", node_size=2),  # flat or 2DH
}


def layer_of(options):
    from toolkit.moe import MoE

    options = dict(options)
    return MoE(
        D,
        FF,
        options.pop("num_experts"),
        top_k=options.pop("top_k", 2),
        capacity_factor=1.0,
        init_std=INIT,
        seed=SEED,
        name="t",
        **options,
    )


def tokens(name, rank):
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{rank}".encode()))
    x = torch.randn(10 + 3 * rank, D, generator=g)
    return x, torch.randn(x.shape, generator=g)


def grads_of(layer):
    from toolkit.moe import gather_experts
    from toolkit.moe.experts import WEIGHTS

    return gather_experts(layer, {f"experts.{n}": getattr(layer.experts, n).grad for n in WEIGHTS})


def layouts(rank):
    from toolkit.trace import recorder

    out = {}
    for name, options in LAYOUTS.items():
        layer = layer_of(options)
        x, probe = tokens(name, rank)
        x.requires_grad_(True)
        recorder.reset()
        y, aux = layer(x)
        ((y * probe).sum() + aux).backward()
        out[name] = {
            "out": y.detach(),
            "x_grad": x.grad,
            "router_grad": layer.gate.router.weight.grad,
            "expert_grads": grads_of(layer),
            "shard": layer.experts.shard,
            "kept": [m["value"]["kept"] for m in recorder.metrics if m["name"] == "moe/t/load"][0],
            "comms": [
                (e["name"], e["args"].get("moe"), e["args"].get("2dh"), e["args"]["bytes_sent"])
                for e in recorder.events
                if e["cat"] == "comm"
            ],
        }
    return out


def two_dh(rank, world):
    """2DH against the flat all-to-all, uneven splits, rank 1 sending nothing."""
    from toolkit import comm
    from toolkit.comm import hierarchical
    from toolkit.trace import recorder

    splits = torch.randint(0, 5, (world, world), generator=torch.Generator().manual_seed(1))
    splits[1] = 0
    ins, outs = splits[rank].tolist(), splits[:, rank].tolist()
    x = torch.cat([torch.full((ins[j], 3), float(100 * rank + j)) for j in range(world)])
    flat, hier = torch.empty(sum(outs), 3), torch.empty(sum(outs), 3)
    recorder.reset()
    comm.all_to_all(flat, x, outs, ins)
    hierarchical.all_to_all(hier, x, outs, ins, node_size=2)
    return {
        "flat": flat,
        "2dh": hier,
        "splits": splits,
        "events": [dict(e["args"], name=e["name"]) for e in recorder.events if e["cat"] == "comm"],
    }


def physics(rank):
    """The emulated link: two ranks of node 0 push 1 MB across at once; rank 3 only receives."""
    import torch.distributed as dist

    from toolkit import comm
    from toolkit.trace import recorder

    out = {}
    with emulate("100 MB/s", "10 us", ranks_per_node=2):
        buf = torch.ones(250_000)  # 1 MB
        comm.barrier()
        start = time.perf_counter()
        if rank < 2:
            comm.send(buf, rank + 2)
        else:
            comm.recv(buf, rank - 2)
        out["push"] = (start, time.perf_counter())
    with emulate(BANDWIDTH, LATENCY):
        rows = [0, 0, 0, 0] if rank == 3 else [5, 5, 5, 5]
        got = [0 if r == 3 else 5 for r in range(4)]
        recorder.reset()
        comm.all_to_all(torch.empty(sum(got), 25), torch.ones(sum(rows), 25), got, rows)
        out["receive_only"] = recorder.events[-1]["args"]
    dist.barrier()
    return out


def skewed_auto_and_dynamic(rank):
    """Auto placement under the skew [90, 4, 3, 3] per rank; dynamic capacity under the prefer() skew."""
    from moe_routing import prefer

    from toolkit.moe import MoE
    from toolkit.trace import recorder

    out = {}
    layer = MoE(32, 64, 4, top_k=1, capacity_factor=4.0, expert_parallel="auto", seed=0, name="auto")
    with torch.no_grad():
        layer.gate.router.weight.zero_()
        layer.gate.router.weight[:, :4] = 10 * torch.eye(4)
    x = torch.zeros(100, 32)
    x[torch.arange(100), torch.tensor([0] * 90 + [1] * 4 + [2] * 3 + [3] * 3)] = 1.0
    recorder.reset()
    layer(x)[0].sum().backward()
    out["auto"] = recorder.metrics[-2]["value"]
    for bound in (4.0, 0.5):
        layer = MoE(D, FF, 4, top_k=2, capacity_factor=bound, dynamic_capacity=True, seed=0, name="dyn")
        prefer(layer.gate.router.weight, 3, 0)
        x = torch.randn(10 + 3 * rank, D)
        x[:, 0] = 1.0
        recorder.reset()
        layer(x)
        out[f"dynamic {bound}"] = recorder.metrics[-1]["value"]
    return out


def slice_weights_priced_and_charged(rank):
    """E=2 on 4 ranks at r=1 (EP+DP): what the emulator charges this rank for the slice weights' collectives
    (forward and backward), and what auto priced them at for the same forward."""
    from toolkit.trace import recorder

    out = {}
    with emulate(BANDWIDTH, LATENCY):
        for mode in ("ep", "auto"):
            layer = layer_of(dict(num_experts=2, expert_slices=1, expert_parallel=mode))
            x, probe = tokens("slices", rank)
            recorder.reset()
            y, aux = layer(x)
            ((y * probe).sum() + aux).backward()
            out[mode] = {
                "charged": sum(
                    e["args"]["emulated_s"]
                    for e in recorder.events
                    if e["cat"] == "comm" and str(e["args"].get("moe", "")).startswith(("slice weights", "output bias"))
                ),
                "parallel": [m["value"] for m in recorder.metrics if m["name"] == "moe/t/parallel"],
            }
    for name, latency in (("latency-bound", "20 ms"), ("bandwidth-bound", "1 us")):  # flat or 2DH, per forward
        with emulate("10 MB/s", latency, intra_node=("1 GB/s", "1 us"), ranks_per_node=2):
            layer = layer_of(dict(num_experts=8, all_to_all_algorithm="auto"))
            recorder.reset()
            layer(tokens("slices", rank)[0] * (1 if name == "latency-bound" else 0) + 1)
            out[name] = {
                "choice": [m["value"] for m in recorder.metrics if m["name"] == "moe/t/all_to_all"],
                "steps": [e["args"].get("2dh") for e in recorder.events if e["name"] == "all_to_all"],
            }
    return out


def everything():
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    return {
        "layouts": layouts(rank),
        "2dh": two_dh(rank, world),
        "physics": physics(rank),
        "skew": skewed_auto_and_dynamic(rank),
        "slices": slice_weights_priced_and_charged(rank),
    }


@functools.cache
def results():
    return toolkit.launch(everything, 4, timeout_s=90)


@functools.cache
def reference(name):
    """The one-rank layer (all experts whole) on every rank's tokens: the oracle."""
    from toolkit.moe import reference_moe

    options = dict(LAYOUTS[name], expert_parallel="ep", all_to_all_algorithm="flat", node_size=None, expert_slices=None)
    options = {k: v for k, v in options.items() if v is not None}
    layer = layer_of(options)
    xs, probes = zip(*(tokens(name, r) for r in range(4)))
    for x in xs:
        x.requires_grad_(True)
    outs, auxes = reference_moe(layer, xs)
    sum((o * p).sum() + a for o, p, a in zip(outs, probes, auxes)).backward()
    return {
        "out": outs,
        "x_grad": [x.grad for x in xs],
        "router_grad": layer.gate.router.weight.grad,
        "expert_grads": grads_of(layer),
    }


def close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.timeout(150)
def test_more_ranks_than_experts_and_2dh_equal_the_one_rank_layer(no_leftover_ranks):
    ranks = results()
    for name in LAYOUTS:
        want = reference(name)
        for rank, res in enumerate(ranks):
            got = res["layouts"][name]
            close(got["out"], want["out"][rank].detach(), f"{name}: output of rank {rank}")
            close(got["x_grad"], want["x_grad"][rank], f"{name}: input gradient of rank {rank}")
            for key, value in want["expert_grads"].items():
                close(got["expert_grads"][key], value, f"{name}: {key} gradient, gathered on rank {rank}")
        close(sum(res["layouts"][name]["router_grad"] for res in ranks), want["router_grad"], f"{name}: router")
    assert [res["layouts"]["E=1, r=2 (EP+DP+MP)"]["shard"] for res in ranks] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    comms = {name: [c[:3] for c in ranks[0]["layouts"][name]["comms"] if c[1] != "counts"] for name in LAYOUTS}
    # EP+MP moves no weight (only the output bias, d_model numbers); EP+DP gathers the expert's slices
    assert ("all_gather", "slice weights", None) not in comms["E=2, r=2 (EP+MP)"]
    assert ("all_gather", "slice weights", None) in comms["E=2, r=1 (EP+DP)"]
    assert ("reduce_scatter", "slice weights backward", None) in comms["E=2, r=1 (EP+DP)"]
    assert [c for c in comms["E=2, r=2, 2DH"] if c[1] == "dispatch"] == [
        ("all_to_all", "dispatch", "counts"),
        ("all_to_all", "dispatch", "intra-node"),
        ("all_to_all", "dispatch", "inter-node"),
    ]


@pytest.mark.timeout(150)
def test_ep_dp_mp_bytes_follow_tutels_table():
    """Bytes a rank's dispatch sends: EP+MP (r = W/E = 2) sends each kept row to both ranks of its expert,
    O(C_g W/E); EP+DP (r = 1) to one of them, O(C_g), and gathers the expert's other slice instead, P/E."""
    from toolkit.moe.sharded import row_destinations

    row = D * 4
    for rank, res in enumerate(results()):
        for name, r, slices in (("E=2, r=2 (EP+MP)", 2, 2), ("E=2, r=1 (EP+DP)", 1, 1)):
            got = res["layouts"][name]
            to = row_destinations(got["kept"], 4, 2, slices)
            assert sum(to) == r * sum(got["kept"])  # every kept row, r copies
            sent = sum(c[3] for c in got["comms"] if c[1] == "dispatch")
            assert sent == (sum(to) - to[rank]) * row, name
        gathered = [c for c in res["layouts"]["E=2, r=1 (EP+DP)"]["comms"] if c[1] == "slice weights"]
        slice_params = D * FF // 2 + FF // 2 + FF // 2 * D  # w1, b1, w2 of one slice
        assert [c[3] for c in gathered] == [slice_params * 4]  # the other slice of my expert


@pytest.mark.timeout(150)
def test_2dh_equals_the_flat_all_to_all_with_its_messages_on_the_trace():
    ranks = results()
    splits = ranks[0]["2dh"]["splits"]
    for rank, res in enumerate(ranks):
        assert torch.equal(res["2dh"]["flat"], res["2dh"]["2dh"]), f"rank {rank}"
        events = res["2dh"]["events"]
        assert [e.get("2dh") for e in events] == [None, "counts", "intra-node", "inter-node"]
        flat, counts, intra, inter = events
        assert len(flat["group"]) == 4 and [len(e["group"]) for e in (counts, intra, inter)] == [2, 2, 2]
        node, local = divmod(rank, 2)
        assert intra["group"] == [2 * node, 2 * node + 1] and inter["group"] == [local, 2 + local]
        # step 2 sends local rank j the blocks for (every node, local j); step 4 sends node m the blocks for
        # (m, my local index) from both ranks of my node: the rows sent are the rank's and its neighbour's
        row = 3 * 4
        assert intra["input_splits"] == [int(splits[rank, j] + splits[rank, 2 + j]) for j in range(2)]
        assert inter["input_splits"] == [
            int(splits[2 * node, 2 * m + local] + splits[2 * node + 1, 2 * m + local]) for m in range(2)
        ]
        assert inter["bytes_sent"] == inter["input_splits"][1 - node] * row
        assert flat["bytes_sent"] == int(splits[rank].sum() - splits[rank, rank]) * row


@pytest.mark.timeout(150)
def test_the_card_is_shared_and_receiving_costs_time_on_real_ranks():
    ranks = results()
    pushes = [res["physics"]["push"] for res in ranks[:2]]
    makespan = max(end for _, end in pushes) - min(start for start, _ in pushes)
    assert makespan >= 0.02, f"two ranks of one node pushed 1 MB each across nodes in {makespan * 1e3:.1f} ms"
    got = ranks[3]["physics"]["receive_only"]
    assert got["bytes_sent"] == 0 and got["emulated_s"] == pytest.approx(3 * LATENCY + 15 * 100 / BANDWIDTH)


@pytest.mark.timeout(150)
def test_auto_picks_dp_when_the_popular_experts_owner_would_receive_too_much_and_capacity_follows_the_load():
    ranks = results()
    for res in ranks:
        auto = res["skew"]["auto"]
        assert auto["choice"] == "dp" and auto["busiest"] == 0 and auto["busiest_rows"] == 270, auto["reason"]
    T = [10 + 3 * r for r in range(4)]  # every token: expert 3 first, expert 0 second -> each needs T_r slots
    for bound, want in ((4.0, max(T)), (0.5, max(math.ceil(2 * 0.5 * t / 4) for t in T))):
        records = [res["skew"][f"dynamic {bound}"] for res in ranks]
        assert {r["capacity"] for r in records} == {want}  # agreed by every rank
        assert [r["dropped"] for r in records] == [2 * max(0, t - want) for t in T]
        assert records[0]["capacity_factor"] == pytest.approx(want * 4 / (2 * T[0]))


# --- one process: encode/decode, options, bad input ------------------------------------------------------
def test_fast_encode_and_decode_equal_the_one_hot_einsums():
    from toolkit.moe import TopKGate
    from toolkit.moe.encode import decode_einsum, decode_index, encode_einsum, encode_index

    torch.manual_seed(0)
    gate = TopKGate(D, 4, top_k=2, capacity_factor=0.75)
    x = torch.randn(24, D, requires_grad=True)
    routing = gate(x)
    assert routing.dropped > 0  # some choices do not fit: both forms must drop the same ones
    expert_out = torch.randn(4, routing.capacity, D, requires_grad=True)
    fast = (encode_index(routing, x), decode_index(routing, expert_out))
    slow = (encode_einsum(routing, x), decode_einsum(routing, expert_out))
    for a, b in zip(fast, slow):
        close(a, b, "encode/decode")
    inputs = (x, expert_out, gate.router.weight)  # the router through the gate weights of decode
    got = torch.autograd.grad(fast[0].square().sum() + fast[1].square().sum(), inputs, retain_graph=True)
    want = torch.autograd.grad(slow[0].square().sum() + slow[1].square().sum(), inputs)
    for a, b, name in zip(got, want, ("x", "expert outputs", "router")):
        close(a, b, f"gradient wrt {name}")


def test_dynamic_capacity_follows_the_load_up_to_its_bound():
    from moe_routing import prefer

    from toolkit.moe import MoE

    x = torch.randn(12, D)
    x[:, 0] = 1.0
    seen = {}
    for name, options in {
        "static 1.0": dict(capacity_factor=1.0),
        "static 4.0": dict(capacity_factor=4.0),
        "dynamic <= 4.0": dict(capacity_factor=4.0, dynamic_capacity=True),
        "dynamic <= 1.0": dict(capacity_factor=1.0, dynamic_capacity=True),
    }.items():
        layer = MoE(D, FF, 4, top_k=2, seed=0, name="dyn", **options)
        prefer(layer.gate.router.weight, 3, 0)  # every token: expert 3, then expert 0 -> 12 rows each
        seen[name] = layer.route(x.reshape(-1, D))
    assert (seen["static 1.0"].capacity, seen["static 1.0"].dropped) == (6, 12)
    assert (seen["static 4.0"].capacity, seen["static 4.0"].dropped) == (24, 0)  # 24 slots, 12 used
    assert (seen["dynamic <= 4.0"].capacity, seen["dynamic <= 4.0"].dropped) == (12, 0)  # what the load needs
    assert (seen["dynamic <= 1.0"].capacity, seen["dynamic <= 1.0"].dropped) == (6, 12)  # held to its bound
    with pytest.raises(ValueError, match="Choose one"):
        MoE(D, FF, 4, dynamic_capacity=True, dropless=True)


def test_tutel_options_bad_input():
    from toolkit.moe import MoE
    from toolkit.moe.options import check_sliceable as _check_sliceable
    from toolkit.moe.sharded import Slicing

    with pytest.raises(ValueError, match="d_ff=15 must be a multiple of 2"):
        Slicing(4, 2, 15)
    with pytest.raises(ValueError, match=r"must divide the 4 ranks per expert; choose one of \[1, 2, 4\]"):
        Slicing(8, 2, 16, slices=3)
    with pytest.raises(ValueError, match="whole experts"):
        _check_sliceable("auto", "plain", 1, "topk")
    with pytest.raises(ValueError, match="Leave it at None"):
        MoE(D, FF, 2, expert_slices=1)
    with pytest.raises(ValueError, match="needs the nodes"):
        MoE(D, FF, 2, all_to_all_algorithm="2dh")
    with pytest.raises(ValueError, match="choose 'flat'"):
        MoE(D, FF, 2, all_to_all_algorithm="tree")
    with pytest.raises(ValueError, match="choose one"):
        MoE(D, FF, 2, all_to_all_algorithm="2dh", node_size=1, schedule="smart")
    with pytest.raises(ValueError, match="must divide the 1 ranks"):
        MoE(D, FF, 2, all_to_all_algorithm="2dh", node_size=2)
    with emulate(1e9, ranks_per_node=1):  # the nodes from the emulated link; one process: the plain layer
        layer = MoE(D, FF, 2, all_to_all_algorithm="2dh")
        assert layer.node_size == 1 and layer(torch.randn(3, D))[0].shape == (3, D)


# --- Tutel's switch with sliced experts: the slice weights are priced, and auto chooses r ----------------
def sliced_layer(expert_slices=None):
    """What Placement.price reads of a layer: E = 2 experts of d_model 32, d_ff 1024 on W = 4 ranks (s = 2)."""
    from types import SimpleNamespace

    from toolkit.moe.sharded import Slicing

    return SimpleNamespace(
        d_model=32,
        d_ff=1024,
        num_experts=2,
        world=4,
        slicing=Slicing(4, 2, 1024, expert_slices),
        experts=SimpleNamespace(w1=torch.zeros(1)),
    )


@pytest.mark.parametrize(
    "rows, expert_slices, want",
    [(100, None, ("ep", 2)), (400, None, ("ep", 1)), (800, None, ("dp", 1)), (800, 1, ("dp", 1)), (400, 1, ("ep", 1))],
)
def test_auto_prices_the_slice_weights_and_chooses_r(rows, expert_slices, want):
    """Every rank keeps n rows for each expert; fp32, training, a unit link (seconds = bytes). Per step:
    DP: all-gather + reduce-scatter of P = 2 x (2 x 32 x 1024 + 1024 + 32) parameters over 4 ranks,
        2 x 3/4 x 4P = 799,104.
    r = 2 (EP+MP): each row goes to both slices of its expert: 4 all-to-alls of 3n rows of 128 B each way,
        1,536n, plus the output bias's gathers (128).
    r = 1 (EP+DP): each row once (768n), plus the slice group's all-gather and reduce-scatter of its two
        slices (2 x 1/2 x 266,240) and the bias: 768n + 266,368.
    So r = 2 below n = 347, r = 1 above, DP above n = 694. Left out, the slice weights made r = 1 at n = 800
    look cheaper than DP (614,400 < 799,104)."""
    from toolkit.moe.placement import Placement, choose_parallel

    slicing, costs = Placement("auto").price(sliced_layer(expert_slices), [[rows, rows]] * 4)
    assert costs["dp_s"] == pytest.approx(799_104)
    assert costs["ep_s"] == pytest.approx(1536 * rows + 128 if costs["r"] == 2 else 768 * rows + 266_368)
    assert (choose_parallel(costs, num_experts=2, expert_params=costs["expert_params"])[0], slicing.r) == want


def test_auto_prices_the_slice_weights_at_what_the_emulator_charges_for_them(no_leftover_ranks):
    for rank, res in enumerate(results()):
        charged, priced = res["slices"]["ep"]["charged"], res["slices"]["auto"]["parallel"][0]
        assert priced["r"] == 1 and charged > 0
        assert priced["ep_weights_s"] == pytest.approx(charged, rel=1e-9), (rank, priced, charged)


def test_the_adaptive_all_to_all_takes_2dh_where_the_model_or_tutels_rule_says():
    """The lecture's "adaptive all-to-all algorithm for different scales (Linear/2DH)". On the crossover test's
    link (above) 2DH wins from 13 nodes of 8; with no emulated link, Tutel's launcher rule: 2DH from 64 nodes
    of at least 8 ranks."""
    from toolkit.comm.emulate import make_settings
    from toolkit.comm.hierarchical import choose

    link = make_settings("100 Gb/s", "5 us", intra_node=("150 GB/s", "2 us"), ranks_per_node=8)
    assert [choose(link, n * 8, 8, 64e6)[0] for n in (2, 12, 13, 32)] == ["flat", "flat", "2dh", "2dh"]
    assert [choose(None, n * g, g, 64e6)[0] for n, g in ((64, 8), (32, 8), (64, 4), (128, 16))] == [
        "2dh",
        "flat",
        "flat",
        "2dh",
    ]
    assert "Tutel's rule of scale" in choose(None, 512, 8, 1.0)[1] and choose(link, 8, 8, 1.0)[0] == "flat"


def test_the_layer_chooses_its_all_to_all_per_forward_on_the_emulated_link(no_leftover_ranks):
    """4 ranks in nodes of 2 on a 10 MB/s network: with 20 ms per message, 2DH's one message across saves
    a latency over the flat one's two; with 1 us the fast pass inside the node is the extra it pays. Every
    rank chooses alike, and the trace shows 2DH's steps only when it ran."""
    ranks = results()
    for name, want in (("latency-bound", "2dh"), ("bandwidth-bound", "flat")):
        choices = [res["slices"][name]["choice"] for res in ranks]
        assert all(c == choices[0] for c in choices) and [c["choice"] for c in choices[0]] == [want], choices[0]
        steps = ranks[0]["slices"][name]["steps"]
        assert ("intra-node" in steps) == (want == "2dh"), steps
