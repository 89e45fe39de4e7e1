"""Issue 6's MoE systems options that change where work happens, never the result: expert shadowing
(FasterMoE), the topology-aware gate (FasterMoE) and switchable DP/EP placement of the experts (Tutel).

1. The shadowing predictor (Algorithm 1 with the paper's latency model) on hand-computed cases.
2. On real ranks (one launch per world size, 2 and 4; every check below compares its results):
   forced and automatic shadow sets, "dp" and "auto" placement give the outputs, input gradients,
   router gradients (summed over ranks) and every expert's gradient (on its owner) of the plain
   layer's brute-force reference (fp32, 1e-5), under balanced and skewed routing.
   The topology gate routes differently by design, so it is checked against a one-process reference
   that gates each rank's chunk with that rank's topology gate (same constrained routing), and its
   constraint is counted independently: choices leaving each rank's node <= L.
3. Bad input: a forced shadow naming experts that do not exist, a node size that does not divide the
   world, unknown placement names, shadowing with data-parallel placement.
"""

from __future__ import annotations

import functools
import math
import zlib

import pytest
import torch
from moe_routing import prefer

import toolkit
from toolkit.moe import MoE, gather_experts, reference_moe
from toolkit.moe.experts import WEIGHTS
from toolkit.moe.placement import choose_parallel, parallel_costs
from toolkit.moe.shadow import choose_shadows, latency_imbalanced, latency_shadowed, predict, worker_loads
from toolkit.moe.topology import TopologyGate, topology_limit

D, FF, SEED, INIT = 8, 16, 7, 0.3
TOL = dict(rtol=1e-5, atol=1e-5)

# Unit choices for the hand-computed cases: H = 1, element_bytes = 1, P = 12 FLOP/s, W_net = 4 B/s.
# Then per row: compute 3*4*alpha*H^2/P = alpha s, all-to-all 4*H/W_net = 1 s; per shadowed expert
# 2 * (2*alpha*H^2)/W_net = alpha s for the broadcast and the gradient return together.
UNITS = dict(H=1, P=12, W_net=4, element_bytes=1)


# --- 1. the predictor, by hand ------------------------------------------------------------------------
def test_two_workers_one_hot_expert_is_shadowed_then_the_tie_stops_the_search():
    # alpha = 1: compute 1 s/row, all-to-all 1 s/row, 1 s per shadowed expert.
    # Worker 0 and worker 1 both send 6 rows to expert 0 (on w0) and 1 row to expert 1 (on w1).
    counts, owners = [[6, 1], [6, 1]], [0, 1]
    # B = [12, 2]: Lat_imbl = max(12 * (1 + 1), 2 * (1 + 1)) = 24
    assert worker_loads(counts, owners) == [12, 2]
    assert latency_imbalanced(counts, owners, alpha=1, **UNITS) == pytest.approx(24)
    # shadow e0 (load 12): B' = [6 (w0's own e0 rows), 2 + 6] -> max 8 * 1 + 2*1*1 = 9 < 24: accept
    assert worker_loads(counts, owners, [0]) == [6, 8]
    assert latency_shadowed(counts, owners, [0], alpha=1, **UNITS) == pytest.approx(9)
    # shadow e1 too (load 2): B' = [6 + 1, 6 + 1] -> 7 + 2 * 1 = 9, not < 9: stop
    choice = choose_shadows(counts, owners, alpha=1, **UNITS)
    assert choice.shadowed == [0]
    assert choice.plain_s == pytest.approx(24) and choice.predicted_s == pytest.approx(9)
    assert [(s["expert"], s["accepted"]) for s in choice.trail] == [(0, True), (1, False)]
    assert [s["latency_s"] for s in choice.trail] == pytest.approx([9, 9])
    assert choice.loads_shadowed == [6, 8]
    assert "stop" in choice.explain() and "shadowed [0]" in choice.explain()


def test_balanced_load_with_big_experts_shadowing_does_not_pay():
    # alpha = 2: compute 2 s/row, all-to-all 1 s/row, 2 s per shadowed expert.
    # Balanced: every worker sends 3 rows to each expert. B = [6, 6]: Lat_imbl = 6 * (2 + 1) = 18.
    counts, owners = [[3, 3], [3, 3]], [0, 1]
    # the first candidate (tie: lower id, e0): B' = [3, 6 + 3] -> 9 * 2 + 2 = 20 >= 18: stop at once
    assert latency_shadowed(counts, owners, [0], alpha=2, **UNITS) == pytest.approx(20)
    choice = choose_shadows(counts, owners, alpha=2, **UNITS)
    assert choice.shadowed == [] and choice.predicted_s == pytest.approx(18) == choice.plain_s
    assert choice.trail == [{"expert": 0, "load": 6.0, "latency_s": pytest.approx(20), "accepted": False}]
    assert choice.loads_shadowed == choice.loads == [6, 6]


def test_four_workers_two_hot_experts_are_shadowed_in_load_order():
    # alpha = 1 (1 s/row compute, 1 s/row wire, 1 s per shadowed expert); expert e on worker e.
    counts = [[8, 4, 1, 1]] * 4  # loads: e0 32, e1 16, e2 4, e3 4
    owners = [0, 1, 2, 3]
    # B = [32, 16, 4, 4]: Lat_imbl = 32 * 2 = 64
    # + e0: B' = [8, 16+8, 4+8, 4+8] -> 24 + 1 = 25 < 64 accept
    # + e1: B' = [8+4, 8+4, 4+12, 4+12] -> 16 + 2 = 18 < 25 accept
    # + e2 (ties with e3 on load 4: lower id first): B' = [13, 13, 13, 4+13] -> 17 + 3 = 20 >= 18 stop
    choice = choose_shadows(counts, owners, alpha=1, **UNITS)
    assert choice.shadowed == [0, 1]
    assert [s["latency_s"] for s in choice.trail] == pytest.approx([25, 18, 20])
    assert [s["expert"] for s in choice.trail] == [0, 1, 2]
    assert choice.plain_s == pytest.approx(64) and choice.predicted_s == pytest.approx(18)
    assert choice.loads_shadowed == [12, 12, 16, 16]


def test_two_experts_per_worker_follow_their_owners():
    # alpha = 1; experts 0, 1 on worker 0 and 2, 3 on worker 1.
    counts, owners = [[5, 5, 1, 0], [5, 5, 0, 1]], [0, 0, 1, 1]
    # B = [20, 2]: Lat_imbl = 40
    # + e0 (load 10, tie with e1: lower id): B' = [10 (e1) + 5, 2 + 5] -> 15 + 1 = 16 accept
    # + e1: B' = [5 + 5, 2 + 5 + 5] -> 12 + 2 = 14 accept
    # + e2 (load 1): B' = [5 + 5 + 1, 1 (e3) + 5 + 5 + 0] -> 11 + 3 = 14, not < 14: stop
    choice = choose_shadows(counts, owners, alpha=1, **UNITS)
    assert choice.shadowed == [0, 1]
    assert [s["latency_s"] for s in choice.trail] == pytest.approx([16, 14, 14])
    assert choice.plain_s == pytest.approx(40)


def test_realistic_sizes_fp32():
    # H = 1024, alpha = 4 (alpha*H^2 = 4,194,304), fp32, P = 10 TFLOP/s, W_net = 10 GB/s:
    #   compute per row 12 * 4194304 / 1e13        = 5.0332e-6 s
    #   wire per row    4 * 1024 * 4 / 1e10         = 1.6384e-6 s
    #   weights         2 * 2 * 4194304 * 4 / 1e10  = 6.7109e-3 s per shadowed expert
    # counts [[4000, 1000], [4000, 1000]]: B = [8000, 2000], Lat_imbl = 8000 * 6.6716e-6 = 0.053373 s
    # + e0: B' = [4000, 6000] -> 6000 * 5.0332e-6 + 6.7109e-3 = 0.036910 s: accept
    # + e1: B' = [5000, 5000] -> 0.025166 + 0.013422 = 0.038588 s: worse, stop
    model = dict(H=1024, alpha=4, P=1e13, W_net=1e10, element_bytes=4)
    choice = choose_shadows([[4000, 1000], [4000, 1000]], [0, 1], **model)
    assert choice.shadowed == [0]
    assert choice.plain_s == pytest.approx(0.053373, rel=1e-4)
    assert [s["latency_s"] for s in choice.trail] == pytest.approx([0.036910, 0.038588], rel=1e-4)
    # a link 100x slower (wire 1.6384e-4 s/row, weights 0.67109 s) and 10x fewer rows: B = [800, 200],
    # Lat_imbl = 800 * (5.0332e-6 + 1.6384e-4) = 0.13510 s; + e0: B' = [400, 600] ->
    # 600 * 5.0332e-6 + 0.67109 = 0.67411 s: moving the weights costs more than the whole layer, stop
    slow = choose_shadows([[400, 100], [400, 100]], [0, 1], **dict(model, W_net=1e8))
    assert slow.shadowed == [] and slow.plain_s == pytest.approx(0.13510, rel=1e-4)
    assert slow.trail[0]["latency_s"] == pytest.approx(0.67411, rel=1e-4)


def test_the_greedy_stops_at_the_first_step_that_does_not_pay():
    # alpha = 1 on a fast link (W_net = 400 B/s): compute 1 s/row, wire 0.01 s/row, 0.01 s per shadowed expert.
    # Symmetric skew: each worker sends 6 rows to each expert. B = [12, 12]: Lat_imbl = 12 * 1.01 = 12.12
    counts, owners, units = [[6, 6], [6, 6]], [0, 1], dict(UNITS, W_net=400)
    # + e0: B' = [6, 12 + 6] -> 18 + 0.01 = 18.01 >= 12.12: stop, nothing shadowed...
    choice = choose_shadows(counts, owners, alpha=1, **units)
    assert choice.shadowed == [] and [s["latency_s"] for s in choice.trail] == pytest.approx([18.01])
    # ...although both together would have paid a little (B' = [12, 12] -> 12 + 0.02 = 12.02 < 12.12):
    # Algorithm 1 is greedy and never looks two experts ahead
    assert latency_shadowed(counts, owners, [0, 1], alpha=1, **units) == pytest.approx(12.02)
    assert choice.plain_s == pytest.approx(12.12)


def test_forced_sets_are_predicted_and_the_model_rejects_bad_tables():
    forced = predict([[6, 1], [6, 1]], [0, 1], [1, 0, 1], alpha=1, **UNITS)
    assert forced.shadowed == [0, 1] and forced.predicted_s == pytest.approx(9)
    assert predict([[6, 1], [6, 1]], [0, 1], [], alpha=1, **UNITS).predicted_s == pytest.approx(24)
    with pytest.raises(ValueError, match="owners"):
        choose_shadows([[1, 2]], [0, 1], alpha=1, **UNITS)  # one worker cannot own expert 1
    with pytest.raises(ValueError, match="workers, experts"):
        choose_shadows([[1, 2], [3]], [0, 1], alpha=1, **UNITS)
    with pytest.raises(ValueError, match="W_net"):
        choose_shadows([[1, 2], [3, 4]], [0, 1], alpha=1, **dict(UNITS, W_net=0))


def test_topology_limit_and_placement_model_by_hand():
    # L = W_net / (M * W_local) * B: 1 GB/s out of a node of 4 workers with 8 GB/s each, 100 rows -> 3.125 -> 3
    assert topology_limit(100, 1e9, 8e9, 4) == 3
    assert topology_limit(100, 64e9, 8e9, 4) == 200  # a fast network constrains nothing (L >= B)
    # 4 ranks, P = 1000 expert parameters fp32: DP sends 2 * 3/4 * 1000 * 4 = 6000 B per training step (on the
    # unit link, seconds are bytes); EP: every rank sends 50 rows of d_model 8 to one other rank and receives
    # 50: 4 all-to-alls * 50 * 8 * 4 = 6400 B -> dp; with 40 rows 5120 B -> ep
    ring = [[0, 50, 0, 0], [0, 0, 50, 0], [0, 0, 0, 50], [50, 0, 0, 0]]
    costs = parallel_costs(ring, expert_params=1000, d_model=8)
    assert (costs["dp_s"], costs["ep_s"], costs["dp_bytes"], costs["ep_bytes"]) == (6000.0, 6400.0, 6000.0, 6400.0)
    assert choose_parallel(costs, num_experts=4, expert_params=1000)[0] == "dp"
    fewer = parallel_costs([[4 * t // 5 for t in row] for row in ring], expert_params=1000, d_model=8)
    choice, reason = choose_parallel(fewer, num_experts=4, expert_params=1000)
    assert choice == "ep" and "O(C_g)" in reason and "5.0 KiB" in reason
    inference = parallel_costs(
        [[4 * t // 5 for t in row] for row in ring], expert_params=1000, d_model=8, training=False
    )
    assert (inference["dp_s"], inference["ep_s"]) == (3000.0, 2560.0)  # all-gather only, dispatch + combine only


def test_topology_gate_keeps_most_rows_in_the_node():
    """2 nodes of 2 ranks, 8 experts (2 per rank, 4 per node); rank 1 is on node 0 (experts 0-3).
    Token t's logits favour expert 7 - (t % 2) (node 1) strongly, then expert t % 4 (node 0)."""
    T, E, k = 10, 8, 1
    gate = TopologyGate(E, E, k, 4.0, world=4, rank=1, node_size=2, cross_fraction=0.25)
    x = torch.zeros(T, E)
    for t in range(T):
        x[t, 7 - t % 2] = 5.0 + 0.1 * t  # later tokens are more confident: they win the few slots
        x[t, t % 4] = 4.0
    with torch.no_grad():
        gate.router.weight.copy_(torch.eye(E))
    routing = gate(x)
    L = math.floor(0.25 * T * k)  # 2 of the 10 rows may leave node 0
    assert gate.limit(T) == L == 2
    assert routing.expert_index[:, 0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 7, 6]  # tokens 8, 9 keep node 1
    assert gate.last == {"node": 0, "wanted": 10, "limit": 2, "sent": 2, "redirected": 8, "per_node": [8, 2]}
    probs = x.softmax(-1)
    torch.testing.assert_close(routing.gate_weight[:, 0], probs.gather(1, routing.expert_index)[:, 0])
    gate.rank = 3  # node 1: everything it wants is local
    routing = gate(x)
    assert routing.expert_index[:, 0].tolist() == [7 - t % 2 for t in range(T)] and gate.last["sent"] == 0


# --- 2. on real ranks -------------------------------------------------------------------------------------
def configs(world):
    """name -> MoE options (+ skew, batch): 2 experts per rank, top-2, capacity 1.0 (skew drops)."""
    E, M = 2 * world, max(1, world // 2)
    base = dict(num_experts=E, top_k=2, capacity_factor=1.0)
    out = {}
    for routing in ("balanced", "skewed"):
        b = dict(base, skew=routing == "skewed")
        out[f"{routing}/plain"] = b
        out[f"{routing}/shadow_forced"] = dict(b, shadow=[0, E - 1], compute_flops=1e9, bandwidth=1e9)
        out[f"{routing}/shadow_forced_one"] = dict(b, shadow=[1], compute_flops=1e9, bandwidth=1e9)
        # slow compute, fast link: shadowing the loaded experts pays
        out[f"{routing}/shadow_auto"] = dict(b, shadow="auto", compute_flops=1e6, bandwidth=1e12)
        # wide experts (d_ff 256), slow link: moving weights costs more than the whole plain layer
        out[f"{routing}/shadow_auto_no_gain"] = dict(b, shadow="auto", d_ff=256, compute_flops=1e15, bandwidth=1e6)
        out[f"{routing}/dp"] = dict(b, expert_parallel="dp")
        out[f"{routing}/auto_parallel_few_tokens"] = dict(b, expert_parallel="auto")
        out[f"{routing}/auto_parallel_many_tokens"] = dict(b, expert_parallel="auto", batch=32)
        # W_net / (M * W_local) = 1/8: at most 1/8 of each rank's rows leave its node
        out[f"{routing}/topology"] = dict(b, gate="topology", node_size=M, bandwidth=1.0, local_bandwidth=8.0 / M)
    out["skewed/shadow_auto_dropless_top1"] = dict(
        base, top_k=1, dropless=True, skew=True, shadow="auto", compute_flops=1e6, bandwidth=1e12
    )
    return out


SYSTEM_OPTIONS = ("shadow", "compute_flops", "bandwidth", "expert_parallel", "gate", "node_size", "local_bandwidth")


def build(options, plain=False):
    """The layer; ``plain`` drops the systems options (the reference's layer)."""
    options = {k: v for k, v in options.items() if k not in ("skew", "batch")}
    if plain:
        options = {k: v for k, v in options.items() if k not in SYSTEM_OPTIONS}
    d_ff = options.pop("d_ff", FF)
    layer = MoE(D, d_ff, init_std=INIT, seed=SEED, name="t", **options)
    return layer


def inputs(name, world, rank, options):
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{world}/{rank}".encode()))
    x = torch.randn(options.get("batch", 2), 5 + 2 * rank, D, generator=g)
    if options.get("skew"):
        x[..., 0] = 1.0
    return x, torch.randn(x.shape, generator=g)


def expert_grads(layer):
    return gather_experts(layer, {f"experts.{n}": getattr(layer.experts, n).grad for n in WEIGHTS})


def one_config(name, options, world, rank):
    from toolkit.trace import recorder

    layer = build(options)
    if options.get("skew"):
        prefer(layer.gate.router.weight, 0, 1)  # experts 0 and 1, both on rank 0
    x, probe = inputs(name, world, rank, options)
    x.requires_grad_(True)
    recorder.reset()
    out, aux = layer(x)
    ((out * probe).sum() + aux).backward()
    metrics = {m["name"].split("/")[-1]: m["value"] for m in recorder.metrics}
    comms = [(e["name"], e["args"].get("moe", e["args"].get("op"))) for e in recorder.events if e["cat"] == "comm"]
    res = {
        "out": out.detach(),
        "aux": aux.detach(),
        "x_grad": x.grad,
        "router_grad": layer.gate.router.weight.grad,
        "expert_grads": expert_grads(layer),
        "metrics": metrics,
        "comms": comms,
    }
    if isinstance(layer.gate, TopologyGate):  # the constraint, counted from the routing itself
        with torch.no_grad():
            routing = layer.gate(x.reshape(-1, D))
        node_of = layer.gate.node_of_expert()
        res["left_node"] = int((node_of[routing.expert_index] != rank // layer.gate.node_size).sum())
        res["limit"] = layer.gate.limit(x.reshape(-1, D).shape[0])
    return res


def checks_with_emulation_and_measurement(rank):
    """Where P and W_net come from: measured on this machine, or the emulated link; the topology gate's
    nodes from the emulated link."""
    from toolkit.trace import recorder

    out = {}
    recorder.reset()
    layer = MoE(D, FF, 4, init_std=INIT, seed=SEED, name="m", shadow="auto")
    layer(torch.randn(6, D))[0].sum().backward()
    out["measured"] = recorder.metrics[0]["value"]
    out["measured_comms"] = [e["args"].get("moe") for e in recorder.events if e["cat"] == "comm"]
    with toolkit.comm.emulate(
        bandwidth="200 MB/s", latency="1 us", intra_node=dict(bandwidth="800 MB/s"), ranks_per_node=1
    ):
        recorder.reset()
        layer = MoE(D, FF, 4, init_std=INIT, seed=SEED, name="e", shadow="auto", compute_flops=1e9)
        layer(torch.randn(6, D))[0].sum().backward()
        out["emulated"] = recorder.metrics[0]["value"]
        topo = MoE(D, FF, 4, init_std=INIT, seed=SEED, gate="topology")
        out["topology"] = (topo.gate.node_size, topo.gate.cross_fraction)
    try:
        MoE(D, FF, 4, gate="topology", node_size=3, bandwidth=1.0, local_bandwidth=1.0)
    except ValueError as exc:
        out["bad_node_size"] = str(exc)
    return out


def training(moe_options):
    """Two DDP steps of the MoE-GPT; SGD so that float noise stays noise (see test_moe_layer)."""
    from toolkit.train import TrainConfig, moe_model_fn, train

    config = TrainConfig(
        strategy="ddp",
        steps=2,
        global_batch_size=4,
        seq_len=16,
        optimizer="sgd",
        lr=0.5,
        model=dict(n_layer=1, d_model=16, n_head=2),
        progress=False,
        sample_memory=False,
    )
    run, state = train(
        config, model_fn=moe_model_fn(4, 2, capacity_factor=1.0, moe_options=moe_options), return_state=True
    )
    return run, state


def everything(world):
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {name: one_config(name, options, world, rank) for name, options in configs(world).items()}
    if world == 2:
        out["where"] = checks_with_emulation_and_measurement(rank)
        out["train"] = {
            key: training(options)
            for key, options in (
                ("plain", {}),
                ("shadow", dict(shadow="auto", compute_flops=1e6, bandwidth=1e12)),
                ("dp", dict(expert_parallel="dp")),
            )
        }
    return out


@functools.cache
def results(world):
    return toolkit.launch(everything, world, args=(world,), timeout_s=60)


@functools.cache
def reference(name, world):
    """One process holding every expert; the topology gate's routing for each chunk's own rank."""
    options = configs(world)[name]
    layer = build(options, plain=True)
    if options.get("skew"):
        prefer(layer.gate.router.weight, 0, 1)  # experts 0 and 1, both on rank 0
    xs, probes = zip(*(inputs(name, world, r, options) for r in range(world)))
    for x in xs:
        x.requires_grad_(True)
    if options.get("gate") == "topology":
        topo = TopologyGate(
            D,
            layer.num_experts,
            layer.top_k,
            options["capacity_factor"],
            world=world,
            rank=0,
            node_size=options["node_size"],
            cross_fraction=options["bandwidth"] / (options["node_size"] * options["local_bandwidth"]),
        )
        topo.router = layer.gate.router  # the same router: only the decision differs
        outs, auxes = [], []
        for r, x in enumerate(xs):
            topo.rank = r
            layer.gate = topo
            (o,), (a,) = reference_moe(layer, [x])
            outs.append(o)
            auxes.append(a)
    else:
        outs, auxes = reference_moe(layer, xs)
    sum((o * p).sum() + a for o, p, a in zip(outs, probes, auxes)).backward()
    return {
        "out": [o.detach() for o in outs],
        "aux": [a.detach() for a in auxes],
        "x_grad": [x.grad for x in xs],
        "router_grad": layer.gate.router.weight.grad,
        "expert_grads": expert_grads(layer),
    }


def close(a, b, what):
    torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", (2, 4))
def test_every_option_equals_the_reference(world, no_leftover_ranks):
    ranks = results(world)
    for name in configs(world):
        ref = reference(name, world)
        for r, res in enumerate(ranks):
            got = res[name]
            close(got["out"], ref["out"][r], f"{name} output, rank {r} of {world}")
            close(got["aux"], ref["aux"][r], f"{name} aux loss, rank {r}")
            close(got["x_grad"], ref["x_grad"][r], f"{name} input grad, rank {r}")
            assert got["expert_grads"].keys() == ref["expert_grads"].keys()
            for key in ref["expert_grads"]:
                close(got["expert_grads"][key], ref["expert_grads"][key], f"{name} grad of {key}, rank {r}")
        close(sum(res[name]["router_grad"] for res in ranks), ref["router_grad"], f"{name} router grad")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", (2, 4))
def test_shadowed_experts_stay_home_and_their_weights_travel(world):
    E = 2 * world
    for routing in ("balanced", "skewed"):
        for name, want in ((f"{routing}/shadow_forced", [0, E - 1]), (f"{routing}/shadow_forced_one", [1])):
            for res in results(world):
                got = res[name]
                assert got["metrics"]["shadow"]["shadowed"] == want and got["metrics"]["shadow"]["mode"] == "forced"
                comms = got["comms"]
                assert comms[0] == ("all_gather", "counts")
                assert [c for c in comms if c[0] == "broadcast"] == [("broadcast", f"shadow expert {e}") for e in want]
                assert [c for c in comms if c[0] == "all_reduce"] == [("all_reduce", "shadow experts backward")]
                # the weights' traffic is posted between the layer's own, where computation can hide it
                # (moe/shadow_steps.py): broadcasts after the dispatch, before the combine; the gradients'
                # all-reduce after the combine's backward, before the dispatch's backward
                at = {c[1]: i for i, c in enumerate(comms)}
                assert all(at["dispatch"] < at[f"shadow expert {e}"] < at["combine"] for e in want)
                assert at["combine"] < at["combine backward"] < at["shadow experts backward"] < at["dispatch backward"]
                # the owners received no row for a shadowed expert through the all-to-all
                load = got["metrics"]["load"]
                for e in want:
                    if load["first"] <= e < load["first"] + len(load["received"]):
                        assert load["received"][e - load["first"]] == 0
                shadow = got["metrics"]["shadow"]
                assert shadow["measured_forward_s"] > 0 and shadow["measured_s"] >= shadow["measured_forward_s"]
                assert shadow["predicted_s"] > 0 and shadow["source"] == {
                    "compute_flops": "given",
                    "bandwidth": "given",
                }


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", (2, 4))
def test_auto_shadowing_is_algorithm_1_on_everyones_counts(world):
    E = 2 * world
    owners = [e // 2 for e in range(E)]
    for name in (
        "balanced/shadow_auto",
        "skewed/shadow_auto",
        "balanced/shadow_auto_no_gain",
        "skewed/shadow_auto_no_gain",
        "skewed/shadow_auto_dropless_top1",
    ):
        ranks = results(world)
        table = [res[name]["metrics"]["load"]["kept"] for res in ranks]  # rows each rank dispatches
        options = configs(world)[name]
        expect = choose_shadows(
            table,
            owners,
            H=D,
            alpha=options.get("d_ff", FF) / D,
            P=options["compute_flops"],
            W_net=options["bandwidth"],
            element_bytes=4,
        )
        records = [res[name]["metrics"]["shadow"] for res in ranks]
        assert all(rec["shadowed"] == sorted(expect.shadowed) for rec in records), name  # all ranks agree
        assert records[0]["predicted_s"] == pytest.approx(expect.predicted_s)
        assert records[0]["plain_s"] == pytest.approx(expect.plain_s)
        broadcasts = [c for c in ranks[0][name]["comms"] if c[0] == "broadcast"]
        assert len(broadcasts) == len(expect.shadowed)
        if "no_gain" in name:
            assert expect.shadowed == [] and not broadcasts, name  # nothing pays: plain path, nothing moved
        if name.startswith("skewed/shadow_auto") and "no_gain" not in name:  # the hot experts, heaviest first
            hot = [0, 1] if options["top_k"] == 2 else [0]  # (equal loads: lower id first)
            assert expect.shadowed[: len(hot)] == hot, (name, expect.trail)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", (2, 4))
def test_topology_gate_respects_its_limit_and_records_it(world):
    for routing in ("balanced", "skewed"):
        name = f"{routing}/topology"
        for r, res in enumerate(results(world)):
            got, rec = res[name], res[name]["metrics"]["topology"]
            T = 2 * (5 + 2 * r)
            L = math.floor(T * 2 / 8 + 1e-9)  # 1/8 of its T*k rows
            assert got["limit"] == rec["limit"] == L
            assert got["left_node"] == rec["sent"] <= L  # counted from the routing itself
            assert rec["kept_sent"] <= rec["sent"] and rec["wanted"] >= rec["sent"]
            assert rec["redirected"] == rec["wanted"] - rec["sent"]
            assert sum(rec["per_node"]) == 2 * T and rec["node"] == r // max(1, world // 2)
    # under skew every rank off the hot experts' nodes wanted out and was held to L
    skewed = [res["skewed/topology"]["metrics"]["topology"] for res in results(world)]
    assert any(rec["wanted"] > rec["limit"] and rec["sent"] == rec["limit"] for rec in skewed)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", (2, 4))
def test_dp_placement_moves_weights_not_tokens_and_auto_explains_itself(world):
    for routing in ("balanced", "skewed"):
        for res in results(world):
            dp = res[f"{routing}/dp"]
            assert [c[0] for c in dp["comms"]] == ["all_gather", "reduce_scatter"]  # no all-to-all at all
            assert dp["metrics"]["parallel"]["choice"] == "dp"
            few = res[f"{routing}/auto_parallel_few_tokens"]["metrics"]["parallel"]
            many = res[f"{routing}/auto_parallel_many_tokens"]["metrics"]["parallel"]
            assert few["choice"] == "ep" and few["ep_s"] <= few["dp_s"] and "ep:" in few["reason"]
            assert many["choice"] == "dp" and many["dp_s"] < many["ep_s"] and "dp:" in many["reason"]
            assert res[f"{routing}/auto_parallel_few_tokens"]["comms"][0] == ("all_gather", "parallel choice")
            assert ("all_to_all", "dispatch") in res[f"{routing}/auto_parallel_few_tokens"]["comms"]
            assert not any(c[0] == "all_to_all" for c in res[f"{routing}/auto_parallel_many_tokens"]["comms"])
        # every rank made the same choice from the same (all-gathered) numbers
        assert (
            len({res[f"{routing}/auto_parallel_many_tokens"]["metrics"]["parallel"]["ep_s"] for res in results(world)})
            == 1
        )


@pytest.mark.timeout(180)
def test_rates_are_measured_or_read_from_the_emulated_link():
    for res in results(2):
        measured, emulated = res["where"]["measured"], res["where"]["emulated"]
        assert measured["source"] == {"compute_flops": "measured", "bandwidth": "measured"}
        assert 0 < measured["compute_flops"] < math.inf and 0 < measured["bandwidth"] < math.inf
        assert "calibrate" in res["where"]["measured_comms"]
        assert emulated["source"] == {"compute_flops": "given", "bandwidth": "emulated"}
        assert emulated["bandwidth"] == pytest.approx(200e6)
        assert res["where"]["topology"] == (1, pytest.approx(200e6 / 800e6))
        assert "node_size=3 does not divide the world size 2" in res["where"]["bad_node_size"]
    # every rank measured, then they agreed: the same numbers everywhere
    assert len({res["where"]["measured"]["compute_flops"] for res in results(2)}) == 1


@pytest.mark.timeout(180)
def test_training_with_shadowing_or_dp_placement_is_training_without(no_leftover_ranks):
    from toolkit.viz.expert_load import expert_load, load_rows

    ranks = results(2)
    plain = [res["train"]["plain"] for res in ranks]
    for option in ("shadow", "dp"):
        for (run, state), (ref_run, ref_state) in zip((res["train"][option] for res in ranks), plain):
            for (s, got), (_, want) in zip(run.metric("loss"), ref_run.metric("loss")):
                assert got == pytest.approx(want, abs=1e-5), f"{option}: loss at step {s}"
            for key, want in ref_state.items():
                close(state[key], want, f"{option}: {key} after training")
    run = toolkit.Run.merge(res["train"]["shadow"][0] for res in ranks)
    records = run.metric("moe/layer0/shadow")
    assert [step for step, _ in records] == [0, 1]  # one record per step, per layer
    assert all(value["mode"] == "auto" and value["measured_s"] for _, value in records)
    rows = load_rows(run, "layer0")
    assert [row["shadowed"] for row in rows] == [value["shadowed"] for _, value in records]
    fig = expert_load(run, "layer0")
    marks = [t for t in fig.data if t.name == "shadowed"]
    if any(row["shadowed"] for row in rows):
        (mark,) = marks
        assert list(zip(mark.x, mark.y)) == [(i, e) for i, row in enumerate(rows) for e in row["shadowed"]]
    placement = toolkit.Run.merge(res["train"]["dp"][0] for res in ranks).metric("moe/layer0/parallel")
    assert [value["choice"] for _, value in placement] == ["dp", "dp"]


# --- 3. bad input ------------------------------------------------------------------------------------------
def test_bad_options_are_clear_errors():
    for bad, named in (([4], "[4]"), ([0, 9], "[9]"), ([-1], "[-1]"), (["0"], "['0']"), ([True], "[True]")):
        with pytest.raises(ValueError, match=r"do not exist; this layer has experts 0\.\.3") as info:
            MoE(D, FF, 4, shadow=bad)
        assert named in str(info.value)
    with pytest.raises(ValueError, match="choose 'off', 'auto' or a list"):
        MoE(D, FF, 4, shadow="on")
    with pytest.raises(ValueError, match="expert_parallel='tp'.*'ep'.*'dp'.*'auto'"):
        MoE(D, FF, 4, expert_parallel="tp")
    with pytest.raises(ValueError, match="needs expert_parallel='ep'"):
        MoE(D, FF, 4, shadow="auto", expert_parallel="dp")
    with pytest.raises(ValueError, match="compute_flops must be a finite number > 0"):
        MoE(D, FF, 4, shadow="auto", compute_flops=0)
    # one process is a world of one: a node of 2 ranks does not divide it
    with pytest.raises(ValueError, match=r"node_size=2 does not divide the world size 1.*\[1\]"):
        MoE(D, FF, 4, gate="topology", node_size=2, bandwidth=1.0, local_bandwidth=1.0)
    with pytest.raises(ValueError, match=r"node_size=3 does not divide the world size 4.*\[1, 2, 4\]"):
        TopologyGate(D, 8, 2, world=4, rank=0, node_size=3, cross_fraction=0.5)
    with pytest.raises(ValueError, match="missing"):
        MoE(D, FF, 4, gate="topology")  # no nodes, no links, no emulation
    with pytest.raises(ValueError, match="fewer than top_k=2"):
        TopologyGate(D, 4, 2, world=4, rank=0, node_size=1, cross_fraction=0.5)
    with pytest.raises(ValueError, match="node_size= describes the nodes for gate=.topology. or all_to_all_algorithm"):
        MoE(D, FF, 4, node_size=2)


def test_one_process_options_equal_the_plain_layer():
    """With no process group every option runs locally (nothing to broadcast or gather) and changes nothing."""
    x = torch.randn(3, 7, D)
    want, _ = build(dict(num_experts=4)).forward(x)
    for options in (
        dict(shadow=[1, 2]),
        dict(shadow="auto", compute_flops=1e6, bandwidth=1e12),
        dict(expert_parallel="dp"),
        dict(expert_parallel="auto"),
    ):
        got, _ = build(dict(num_experts=4, **options)).forward(x)
        close(got, want, f"one process, {options}")
