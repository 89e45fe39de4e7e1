"""The expert-parallel MoE layer against the one-process brute-force reference that holds all experts.

Same weights (layout-independent init: expert i depends only on (seed, i)), same tokens (rank r feeds
its own, of a different length per rank; the reference processes every rank's chunk, gated on its
own as a rank does). Outputs, input gradients, router gradients (summed over ranks) and every expert's
weight gradients (gathered under global names) must agree to fp32 precision at world sizes 1, 2 and 4,
with one and two experts per rank, top-1 and top-2, with and without dropping, dropless, and under
extreme skew. One launch per world size runs every check (`results(n)`, cached); the tests compare.
"""

from __future__ import annotations

import functools
import math
import zlib

import pytest
import torch
from moe_routing import prefer

import toolkit
from toolkit.moe import MoE, gather_experts, is_expert, merge_load, reference_moe
from toolkit.moe.experts import WEIGHTS

D, FF, SEED, INIT = 8, 16, 7, 0.3
TOL = dict(rtol=1e-5, atol=1e-5)
WORLDS = (1, 2, 4)


def configs(world):
    """name -> layer options; `skew` routes every token to the last expert (then to expert 0)."""
    out = {}
    for per_rank in (1, 2):
        E = per_rank * world
        for k in (1, 2):
            if k > E:
                continue
            out[f"e{per_rank}_top{k}_drop"] = dict(num_experts=E, top_k=k, capacity_factor=0.5)
            out[f"e{per_rank}_top{k}_nodrop"] = dict(num_experts=E, top_k=k, capacity_factor=float(E))
    E = 2 * world
    out["dropless"] = dict(num_experts=E, top_k=2, capacity_factor=0.5, dropless=True)
    out["skew"] = dict(num_experts=max(4, E), top_k=2, capacity_factor=1.0, skew=True)
    return out


def build(options):
    options = dict(options)
    skew = options.pop("skew", False)
    layer = MoE(D, FF, init_std=INIT, seed=SEED, name="test", **options)
    if skew:  # every token: the last expert first, then expert 0
        prefer(layer.gate.router.weight, layer.num_experts - 1, 0)
    return layer


def inputs(name, world, rank, skew=False):
    """Rank r's tokens, (2, 5 + 2r, D): ranks send different numbers of rows; and a probe for the loss."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{world}/{rank}".encode()))
    x = torch.randn(2, 5 + 2 * rank, D, generator=g)
    if skew:
        x[..., 0] = 1.0
    return x, torch.randn(x.shape, generator=g)


def expert_grads(layer):
    return gather_experts(layer, {f"experts.{n}": getattr(layer.experts, n).grad for n in WEIGHTS})


def expert_weights(layer):
    return gather_experts(layer, {f"experts.{n}": getattr(layer.experts, n).detach() for n in WEIGHTS})


# --- what every rank runs ---------------------------------------------------------------------------
def one_config(name, options, world, rank):
    from toolkit.trace import recorder

    layer = build(options)
    x, probe = inputs(name, world, rank, options.get("skew", False))
    x.requires_grad_(True)
    recorder.reset()
    out, aux = layer(x)
    ((out * probe).sum() + aux).backward()
    comms = [(e["name"], e["args"].get("moe", e["args"].get("op"))) for e in recorder.events if e["cat"] == "comm"]
    return {
        "out": out.detach(),
        "aux": aux.detach(),
        "x_grad": x.grad,
        "router_grad": layer.gate.router.weight.grad,
        "expert_grads": expert_grads(layer),
        "weights": expert_weights(layer),
        "load": recorder.metrics[-1]["value"],
        "comms": comms,
        "tagged": sorted(n for n, p in layer.named_parameters() if is_expert(p)),
    }


def moe_gpt_training(strategy):
    from toolkit.train import moe_model_fn, train

    built = []

    def keep(config):
        built.append(moe_model_fn(4, 2, capacity_factor=1.0)(config))
        return built[-1]

    run, state = train(train_config(strategy), model_fn=keep, return_state=True)
    local = {n: p.detach().clone() for n, p in built[0].named_parameters() if is_expert(p)}
    return run, state, local


def everything(world):
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {name: one_config(name, options, world, rank) for name, options in configs(world).items()}
    if world > 1:  # experts that do not split over the ranks: a clear error on every rank
        try:
            MoE(D, FF, 2 * world + 1)
        except ValueError as exc:
            out["indivisible"] = str(exc)
    if world == 4:  # the hand-written pairwise all-to-all (comm.using("ring")) carries the same layer
        with toolkit.comm.using("ring"):
            out["pairwise"] = one_config("e2_top2_drop", configs(world)["e2_top2_drop"], world, rank)
    if world == 2:
        for strategy in ("ddp", "dp"):
            out[f"train_{strategy}"] = moe_gpt_training(strategy)
    return out


@functools.cache
def results(world):
    return toolkit.launch(everything, world, args=(world,), timeout_s=60)


# --- the reference, in this process ------------------------------------------------------------------
@functools.cache
def reference(name, world):
    options = configs(world)[name]
    layer = build(options)
    xs, probes = zip(*(inputs(name, world, r, options.get("skew", False)) for r in range(world)))
    for x in xs:
        x.requires_grad_(True)
    outs, auxes = reference_moe(layer, xs)
    sum((o * p).sum() + a for o, p, a in zip(outs, probes, auxes)).backward()
    return {
        "out": [o.detach() for o in outs],
        "aux": [a.detach() for a in auxes],
        "x_grad": [x.grad for x in xs],
        "router_grad": layer.gate.router.weight.grad,
        "expert_grads": expert_grads(layer),
        "weights": expert_weights(layer),
    }


def close(a, b, what):
    torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", WORLDS)
def test_expert_parallel_equals_reference(world, no_leftover_ranks):
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
                close(got["weights"][key], ref["weights"][key], f"{name} {key} init (layout-independent)")
                close(got["expert_grads"][key], ref["expert_grads"][key], f"{name} grad of {key}, rank {r}")
        router = sum(res[name]["router_grad"] for res in ranks)  # replicated: each rank has its tokens' part
        close(router, ref["router_grad"], f"{name} router grad summed over ranks")
        dropped = sum(res[name]["load"]["dropped"] for res in ranks)
        drops = name.endswith("_drop") or name == "skew"  # the configurations meant to drop do drop
        assert (dropped > 0) == drops, f"{name}: {dropped} dropped choices"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", WORLDS)
def test_counts_dispatch_combine_and_backward_are_all_to_alls(world):
    comms = results(world)[0]["e2_top2_drop"]["comms"]
    assert comms == [
        ("all_to_all", "counts"),
        ("all_to_all", "dispatch"),
        ("all_to_all", "combine"),
        ("all_to_all", "combine backward"),
        ("all_to_all", "dispatch backward"),
    ]
    # dropless: one all-reduce MAX of the capacity first, so every rank's buffers agree
    assert results(world)[0]["dropless"]["comms"][0] == ("all_reduce", "max")
    loads = [res["dropless"]["load"] for res in results(world)]
    assert len({load["capacity"] for load in loads}) == 1 and all(load["dropped"] == 0 for load in loads)
    assert loads[0]["capacity"] == max(max(load["counts"]) for load in loads)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", WORLDS)
def test_extreme_skew_drops_exactly_what_capacity_demands(world):
    options = configs(world)["skew"]
    E, k = options["num_experts"], options["top_k"]
    received = torch.zeros(E, dtype=torch.long)
    for r, res in enumerate(results(world)):
        load, T = res["skew"]["load"], 2 * (5 + 2 * r)
        C = math.ceil(k * options["capacity_factor"] * T / E)
        targets = [E - 1, 0][:k]
        assert load["capacity"] == C
        assert load["counts"] == [T if e in targets else 0 for e in range(E)]
        assert load["kept"] == [min(T, C) if e in targets else 0 for e in range(E)]
        assert load["dropped"] == k * (T - min(T, C)) > 0
        assert load["max_over_mean"] == pytest.approx(E / k)
        received[load["first"] : load["first"] + len(load["received"])] += torch.tensor(load["received"])
    kept = sum(
        min(2 * (5 + 2 * r), math.ceil(k * options["capacity_factor"] * 2 * (5 + 2 * r) / E)) for r in range(world)
    )
    assert received.tolist() == [kept if e in [E - 1, 0][:k] else 0 for e in range(E)]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", (2, 4))
def test_experts_that_do_not_split_over_the_ranks_are_refused(world):
    for res in results(world):
        assert f"num_experts={2 * world + 1}" in res["indivisible"] and f"{world} ranks" in res["indivisible"]


@pytest.mark.timeout(150)
def test_hand_written_pairwise_all_to_all_gives_the_same_layer():
    ref = reference("e2_top2_drop", 4)
    for r, res in enumerate(results(4)):
        got = res["pairwise"]
        assert got["comms"][:3] == [("all_to_all", "counts"), ("all_to_all", "dispatch"), ("all_to_all", "combine")]
        close(got["out"], ref["out"][r], f"pairwise output, rank {r}")
        close(got["x_grad"], ref["x_grad"][r], f"pairwise input grad, rank {r}")
        for key in ref["expert_grads"]:
            close(got["expert_grads"][key], ref["expert_grads"][key], f"pairwise grad of {key}")


def test_expert_parameters_are_tagged_with_global_names():
    assert results(1)[0]["e1_top1_drop"]["tagged"] == [f"experts.{n}" for n in sorted(WEIGHTS)]
    layer = build(configs(2)["e2_top2_drop"])
    assert not is_expert(layer.gate.router.weight)
    names = expert_weights(layer)
    assert sorted(names) == sorted(f"experts.{i}.{n}" for i in range(4) for n in WEIGHTS)
    assert names["experts.3.w1"].shape == (D, FF) and names["experts.3.b2"].shape == (D,)


# --- in this process -------------------------------------------------------------------------------------
def test_one_process_layer_equals_brute_force():
    """With no process group the layer holds every expert; its sort/dispatch/combine path is exact."""
    for options in (dict(num_experts=4, top_k=2, capacity_factor=0.75), dict(num_experts=3, top_k=1)):
        layer = build(options)
        x, probe = inputs("local", 1, 0)
        out, aux = layer(x)
        ref, ref_aux = reference_moe(layer, [x])
        close(out, ref[0], "one-process output")
        close(aux, ref_aux[0], "one-process aux")


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="top_k=5 is larger than num_experts=4"):
        MoE(D, FF, 4, top_k=5)
    for factor in (0, -1.0):
        with pytest.raises(ValueError, match="capacity_factor"):
            MoE(D, FF, 4, capacity_factor=factor)
    layer = MoE(D, FF, 4)
    with pytest.raises(ValueError, match=r"d_model=8\), got \(3, 7\)"):
        layer(torch.randn(3, 7))
    # issue 6's options and their bad input: tests/test_moe_systems.py (schedule, pipeline_degree) and
    # tests/test_moe_shadow.py (shadow, gate="topology", expert_parallel)
    for option in (dict(shadow="on"), dict(pipeline_degree=0), dict(schedule="fast"), dict(gate="hash")):
        with pytest.raises(ValueError, match="choose"):
            MoE(D, FF, 4, **option)


def test_load_record_on_a_hand_made_routing():
    """Token t's only large feature names its expert: counts [5, 2, 1, 0], capacity 2, top-1."""
    from toolkit.trace import recorder

    layer = MoE(4, 8, 4, top_k=1, capacity_factor=1.0, name="hand")
    with torch.no_grad():
        layer.gate.router.weight.copy_(torch.eye(4))
    target = torch.tensor([0, 0, 1, 0, 2, 1, 0, 0])
    recorder.reset()
    out, _ = layer(5.0 * torch.nn.functional.one_hot(target, 4).float())
    (record,) = [m for m in recorder.metrics if m["name"] == "moe/hand/load"]
    value = record["value"]
    assert value["counts"] == [5, 2, 1, 0] and value["kept"] == [2, 2, 1, 0] and value["received"] == [2, 2, 1, 0]
    assert value["dropped"] == 3 and value["capacity"] == 2 and value["first"] == 0
    assert value["max_over_mean"] == pytest.approx(2.5) and value["cv"] == pytest.approx(math.sqrt(3.5) / 2)
    assert (out[[3, 6, 7]] == 0).all() and (out[[0, 1, 2, 4, 5]] != 0).any(dim=1).all()  # dropped add nothing
    two_ranks = [
        dict(record, rank=0),
        dict(record, rank=1, value=dict(value, counts=[0, 0, 1, 1], kept=[0, 0, 1, 1], dropped=0)),
    ]
    (merged,) = merge_load(two_ranks, "hand")
    assert merged["counts"] == [5, 2, 2, 1] and merged["kept"] == [2, 2, 2, 1] and merged["dropped"] == 3
    assert merged["max_over_mean"] == pytest.approx(2.0)


# --- the MoE-GPT: expert parallel + data parallel = one process ---------------------------------------
def train_config(strategy, accumulation=1):
    """SGD: Adam divides a gradient by its own size, so the attention key bias's exactly-zero gradient
    (float noise, different on every layout) would become an lr-sized step; SGD keeps noise noise."""
    from toolkit.train import TrainConfig

    return TrainConfig(
        strategy=strategy,
        steps=3,
        global_batch_size=4,
        accumulation=accumulation,
        seq_len=16,
        model=dict(n_layer=2, d_model=16, n_head=2),
        optimizer="sgd",
        lr=0.5,
        progress=False,
        sample_memory=False,
    )


@functools.cache
def one_process_moe_gpt():
    """Accumulating the two ranks' halves as micro-batches is what 2 expert-parallel ranks compute."""
    from toolkit.train import moe_model_fn, train

    return train(
        train_config("local", accumulation=2), model_fn=moe_model_fn(4, 2, capacity_factor=1.0), return_state=True
    )


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", ("ddp", "dp"))
def test_moe_gpt_expert_parallel_training_matches_one_process(strategy):
    ref_run, ref_state = one_process_moe_gpt()
    ranks = [res[f"train_{strategy}"] for res in results(2)]
    for run, _, _ in ranks:
        for (s, got), (_, want) in zip(run.metric("loss", rank=run.ranks[0]), ref_run.metric("loss")):
            assert got == pytest.approx(want, abs=1e-5), f"loss at step {s}"
    states = [state for _, state, _ in ranks]
    locals_ = [local for _, _, local in ranks]
    for key in locals_[0]:  # what each rank holds: its own experts, different from the other rank's
        assert not torch.equal(locals_[0][key], locals_[1][key]), f"{key}: ranks hold different experts"
    torch.manual_seed(0)
    init = toolkit.models.moe_gpt(4, 2, seed=0, seq_len=16, n_layer=2, d_model=16, n_head=2).state_dict()
    assert any(".experts.3." in key for key in ref_state), "full state dicts name experts globally"
    for key, want in ref_state.items():
        if ".experts." in key:  # gathered from its owner (rank i // 2) under its global name, on every rank
            for r, state in enumerate(states):
                close(state[key], want, f"{strategy}: {key} on rank {r}")
            prefix, i, name = key.rsplit(".", 2)
            assert not torch.equal(want, init[f"{prefix}.{name}"][int(i)]), f"{key}: the experts trained"
        else:
            close(states[0][key], want, f"{strategy}: {key}")
            assert torch.equal(states[0][key], states[1][key]), f"{key}: dense parameters identical on all ranks"
    # the load in the Run: per step, the ranks' records sum to the one process's two micro-batches
    merged = merge_load(toolkit.Run.merge(run for run, _, _ in ranks).metrics, "layer0")
    want = {}
    for row in merge_load(ref_run.metrics, "layer0"):
        want[row["step"]] = [a + b for a, b in zip(want.get(row["step"], [0] * 4), row["counts"])]
    assert [row["step"] for row in merged] == [0, 1, 2]
    assert [row["counts"] for row in merged] == [want[s] for s in range(3)]
    assert all(sum(row["counts"]) == 4 * 16 * 2 for row in merged)


def _clip_and_zero_with_experts():
    """Clipping with experts: one global norm on every rank; sharded strategies refuse experts clearly."""
    from toolkit.models import moe_gpt

    torch.manual_seed(0)
    model = moe_gpt(4, 2, seed=0, seq_len=16, n_layer=1, d_model=16, n_head=2)
    wrapped, _ = toolkit.parallel.wrap(model, "ddp", optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    import torch.distributed as dist

    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    wrapped(x, x).backward()
    own = sum(float(p.grad.pow(2).sum()) for p in wrapped.module.parameters() if is_expert(p))
    dense = sum(float(p.grad.pow(2).sum()) for p in wrapped.module.parameters() if not is_expert(p))
    norm = float(wrapped.clip_grad_norm_(1e-3))
    try:
        toolkit.parallel.wrap(moe_gpt(4, 2, seed=0, seq_len=16, n_layer=1, d_model=16, n_head=2), "zero2")
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return norm, own, dense, refused


@pytest.mark.timeout(120)
def test_clipping_counts_every_ranks_experts_and_zero_refuses_them(no_leftover_ranks):
    results = toolkit.launch(_clip_and_zero_with_experts, 2, timeout_s=60)
    (n0, own0, dense0, refused), (n1, own1, dense1, _) = results
    assert dense0 == pytest.approx(dense1, rel=1e-6)  # dense gradients are averaged: the same everywhere
    assert own0 != pytest.approx(own1)  # each rank's experts are its own
    assert n0 == pytest.approx(n1, rel=1e-6) == pytest.approx(math.sqrt(dense0 + own0 + own1), rel=1e-5)
    assert "does not handle expert-parallel parameters" in refused and "'zero2'" in refused
