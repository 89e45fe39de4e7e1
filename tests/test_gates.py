"""Tests for toolkit/moe/gates.py: capacity, slots and dropping, the balance losses, load statistics."""

import math

import pytest
import torch

from toolkit.moe.gates import (
    Routing,
    TopKGate,
    capacity,
    gshard_aux_loss,
    load_stats,
    router_z_loss,
    switch_aux_loss,
)

GOLDEN_PROBS = [[0.5, 0.4, 0.1], [0.3, 0.3, 0.4], [0.1, 0.2, 0.7], [0.8, 0.2, 0.0]]


def fixed_gate(num_experts, top_k, capacity_factor=1.0, **kw):
    """A gate whose router is the identity, so the input rows *are* the logits."""
    gate = TopKGate(num_experts, num_experts, top_k, capacity_factor, **kw)
    with torch.no_grad():
        gate.router.weight.copy_(torch.eye(num_experts))
    return gate


# --- losses ----------------------------------------------------------------------------------


def test_gshard_aux_loss_golden_value():
    probs = torch.tensor(GOLDEN_PROBS, dtype=torch.float64)
    loss = gshard_aux_loss(probs, probs.argmax(dim=1))
    assert loss.item() == pytest.approx(1.0875, abs=1e-12)
    probs32 = probs.float()
    assert gshard_aux_loss(probs32, probs32.argmax(dim=1)).item() == pytest.approx(1.0875, rel=1e-6)


def test_gshard_aux_loss_is_one_when_balanced_and_E_when_collapsed():
    E = 4
    uniform = torch.full((8, E), 1.0 / E, dtype=torch.float64)
    assert gshard_aux_loss(uniform, torch.arange(8) % E).item() == pytest.approx(1.0)
    collapsed = torch.zeros(8, E, dtype=torch.float64)
    collapsed[:, 0] = 1.0
    assert gshard_aux_loss(collapsed, torch.zeros(8, dtype=torch.long)).item() == pytest.approx(E)


def test_switch_aux_loss_hand_computed():
    # f = [2/4, 0, 2/4] (argmax picks 0, 2, 2, 0), P = [1.7, 1.1, 1.2] / 4
    # alpha * E * sum f*P = 0.01 * 3 * (0.5*0.425 + 0.5*0.3) = 0.010875
    probs = torch.tensor(GOLDEN_PROBS, dtype=torch.float64)
    top1 = probs.argmax(dim=1)
    assert switch_aux_loss(probs, top1).item() == pytest.approx(0.010875, abs=1e-14)
    assert switch_aux_loss(probs, top1, alpha=1.0).item() == pytest.approx(0.3625 * 3, abs=1e-12)


def test_router_z_loss_hand_computed():
    logits = torch.tensor([[0.0, 0.0], [2.0, 2.0]], dtype=torch.float64)
    expected = (math.log(2) ** 2 + (2 + math.log(2)) ** 2) / 2
    assert router_z_loss(logits).item() == pytest.approx(expected, abs=1e-12)


def test_empty_batch_losses_are_zero_not_nan():
    probs = torch.zeros(0, 3)
    top1 = torch.zeros(0, dtype=torch.long)
    assert gshard_aux_loss(probs, top1).item() == 0.0
    assert switch_aux_loss(probs, top1).item() == 0.0
    assert router_z_loss(probs).item() == 0.0


# --- capacity --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "T,E,k,f,minc,expected",
    [
        (8, 4, 2, 1.25, 1, 5),  # 2*1.25*8/4 = 5 exactly
        (10, 4, 1, 1.0, 1, 3),  # 2.5 rounds up
        (10, 4, 2, 1.0, 1, 5),
        (9, 4, 1, 1.0, 1, 3),  # 2.25 rounds up
        (10, 11, 1, 1.1, 1, 1),  # 1.0000000000000002 in floats must still be 1
        (100, 8, 2, 1.0, 1, 25),
        (0, 4, 2, 1.0, 1, 1),  # min_capacity
        (4, 8, 1, 1.0, 4, 4),  # ceil(0.5) = 1, raised to min_capacity 4
        (4, 8, 1, 1.0, 0, 1),
    ],
)
def test_capacity_formula(T, E, k, f, minc, expected):
    assert capacity(T, E, k, f, minc) == expected


@pytest.mark.parametrize(
    "args,match",
    [
        ((8, 4, 2, 0.0), r"capacity_factor=0.0: .*Tutel's spelling of dynamic capacity.*dropless=True"),
        ((8, 4, 2, -1.0), r"capacity_factor=-1.0: .*dynamic_capacity=True, capacity_factor=1.0"),
        ((8, 4, 2, float("nan")), "capacity_factor"),
        ((8, 4, 2, float("inf")), "capacity_factor"),
        ((8, 4, 5, 1.0), r"top_k=5 is larger than num_experts=4.*top_k <= 4"),
        ((8, 4, 0, 1.0), "top_k must be an int >= 1"),
        ((8, 0, 1, 1.0), "num_experts must be an int >= 1"),
        ((-1, 4, 1, 1.0), "num_tokens must be an int >= 0"),
        ((8.0, 4, 1, 1.0), "num_tokens must be an int"),
        ((8, 4, 1, 1.0, -1), "min_capacity must be an int >= 0"),
    ],
)
def test_capacity_errors_explain(args, match):
    with pytest.raises(ValueError, match=match):
        capacity(*args)


# --- slots, capacity and dropping ------------------------------------------------------------


def test_overflow_keeps_the_first_tokens_in_token_order():
    gate = fixed_gate(3, top_k=1, capacity_factor=1.0)  # C = ceil(6/3) = 2
    x = torch.tensor([[5.0, 0.0, 0.0]] * 6)  # all six tokens want expert 0
    r = gate(x)
    assert r.capacity == 2
    assert r.expert_index.squeeze(1).tolist() == [0] * 6
    assert r.slot.squeeze(1).tolist() == [0, 1, 2, 3, 4, 5]
    assert r.kept.squeeze(1).tolist() == [True, True, False, False, False, False]
    assert r.counts.tolist() == [6, 0, 0]
    assert r.kept_counts.tolist() == [2, 0, 0]
    assert r.dropped == 4


def test_top2_all_first_choices_get_slots_before_second_choices():
    gate = fixed_gate(2, top_k=2, capacity_factor=1.0)  # C = ceil(2*3/2) = 3
    x = torch.tensor(
        [
            [2.0, 1.0],  # token 0: first e0, second e1
            [1.0, 2.0],  # token 1: first e1, second e0
            [2.0, 1.0],
        ]
    )  # token 2: first e0, second e1
    r = gate(x)
    assert r.expert_index.tolist() == [[0, 1], [1, 0], [0, 1]]
    # choice 0: t0->e0 slot 0, t1->e1 slot 0, t2->e0 slot 1; then choice 1: t0->e1 slot 1, t1->e0 slot 2, t2->e1 slot 2
    assert r.slot.tolist() == [[0, 1], [0, 2], [1, 2]]
    assert r.kept.all()
    r2 = r.with_capacity(2)  # token 0's second choice loses to token 2's first choice
    assert r2.kept.tolist() == [[True, True], [True, False], [True, False]]
    assert r2.kept_counts.tolist() == [2, 2]
    assert r2.dropped == 2
    assert r.capacity == 3 and r.dropped == 0  # with_capacity returns a new record


@pytest.mark.parametrize("k,f", [(1, 1.0), (2, 1.25), (2, 0.5), (3, 2.0)])
def test_kept_counts_and_slot_invariants(k, f):
    torch.manual_seed(0)
    E, T = 5, 37
    gate = TopKGate(16, E, k, f)
    r = gate(torch.randn(T, 16))
    assert r.counts.sum().item() == T * k
    assert torch.equal(r.kept_counts, r.counts.clamp(max=r.capacity))
    per_expert_kept = torch.bincount(r.expert_index[r.kept], minlength=E)
    assert torch.equal(per_expert_kept, r.kept_counts)
    assert r.dropped == T * k - r.kept_counts.sum().item()
    for e in range(E):  # slots of expert e are exactly 0..counts[e]-1, each once
        assert sorted(r.slot[r.expert_index == e].tolist()) == list(range(r.counts[e].item()))
    # each token picks distinct experts
    assert all(len(set(row)) == k for row in r.expert_index.tolist())


def test_extreme_skew():
    E, T = 4, 32
    gate = fixed_gate(E, top_k=1, capacity_factor=1.0)
    x = torch.zeros(T, E)
    x[:, 2] = 10.0
    r = gate(x)
    assert r.counts.tolist() == [0, 0, T, 0]
    assert r.capacity == 8 and r.kept_counts.tolist() == [0, 0, 8, 0] and r.dropped == T - 8
    assert r.aux_loss.item() == pytest.approx(E, rel=1e-3)  # GShard loss -> E at collapse
    s = load_stats(r.counts)
    assert s["max_over_mean"] == pytest.approx(E)
    assert s["cv"] == pytest.approx(math.sqrt(E - 1))
    assert s["idle"] == E - 1


def test_dropless_keeps_everything_and_with_capacity_syncs():
    E, T = 4, 20
    gate = fixed_gate(E, top_k=2, dropless=True)
    x = torch.zeros(T, E)
    x[:, 0], x[:, 1] = 10.0, 5.0
    x[:3, 3] = 20.0
    r = gate(x)
    assert r.dropped == 0 and r.kept.all()
    assert r.capacity == r.counts.max().item() == T
    assert torch.equal(r.kept_counts, r.counts)
    # another rank had a bigger max: the agreed capacity keeps everything too
    assert r.with_capacity(T + 7).dropped == 0 and r.with_capacity(T + 7).capacity == T + 7
    assert r.with_capacity(5).dropped > 0


# --- weights and gradients -------------------------------------------------------------------


def test_topk_weight_normalisation():
    torch.manual_seed(1)
    x = torch.randn(10, 8)
    g2 = TopKGate(8, 4, top_k=2)
    r2 = g2(x)
    assert torch.allclose(r2.gate_weight.sum(-1), torch.ones(10))
    probs = torch.softmax(x @ g2.router.weight.t(), -1)
    g2.normalize_topk = False
    assert torch.allclose(g2(x).gate_weight, probs.gather(1, r2.expert_index))
    g1 = TopKGate(8, 4, top_k=1)  # Switch: raw probability even with normalize_topk=True
    r1 = g1(x)
    probs1 = torch.softmax(x @ g1.router.weight.t(), -1)
    assert torch.allclose(r1.gate_weight.squeeze(1), probs1.max(-1).values)


@pytest.mark.parametrize("k,aux", [(1, "switch"), (2, "gshard")])
def test_gradients_reach_the_router(k, aux):
    torch.manual_seed(2)
    gate = TopKGate(8, 4, top_k=k, aux_loss=aux, z_loss_weight=1e-3)
    r = gate(torch.randn(12, 8))
    coeff = torch.randn_like(r.gate_weight)  # not a plain sum: normalised top-2 weights sum to 1
    for term in [(r.gate_weight * coeff).sum(), r.aux_loss, r.z_loss, r.loss]:
        gate.zero_grad()
        term.backward(retain_graph=True)
        assert gate.router.weight.grad is not None
        assert gate.router.weight.grad.abs().sum() > 0


def test_dense_forms_match_the_routing():
    torch.manual_seed(3)
    T, E, d = 9, 3, 8
    gate = TopKGate(d, E, top_k=2, capacity_factor=0.75)
    x = torch.randn(T, d)
    r = gate(x)
    cw, dm = r.combine_weights(), r.dispatch_mask()
    C = r.capacity
    assert cw.shape == dm.shape == (T, E, C)
    assert dm.sum().item() == r.kept.sum().item()
    assert dm.sum(0).max().item() <= 1  # one token per slot
    assert torch.equal(cw != 0, dm)
    assert torch.allclose(cw.sum((1, 2)), (r.gate_weight * r.kept).sum(1))
    # dense dispatch equals the index form
    dense = torch.einsum("tec,td->ecd", dm.float(), x).reshape(E * C, d)
    idx = r.buffer_index()
    buf = x.new_zeros(E * C, d)
    tok = torch.arange(T)[:, None].expand_as(idx)
    buf[idx[r.kept]] = x[tok[r.kept]]
    assert torch.allclose(dense, buf)
    assert (idx[~r.kept] == -1).all()
    cw.sum().backward()
    assert gate.router.weight.grad is not None


# --- determinism, noise, precision ------------------------------------------------------------


def test_determinism_and_noise():
    def build():
        torch.manual_seed(4)
        return TopKGate(8, 6, top_k=2, noisy=True, noise_std=3.0)

    a, b = build(), build()
    x = torch.randn(64, 8)
    ra = a(x, generator=torch.Generator().manual_seed(7))
    rb = b(x, generator=torch.Generator().manual_seed(7))
    assert torch.equal(ra.expert_index, rb.expert_index) and torch.equal(ra.gate_weight, rb.gate_weight)
    rc = a(x, generator=torch.Generator().manual_seed(8))
    assert not torch.equal(ra.expert_index, rc.expert_index)  # noise changes the choices
    a.eval()  # eval: no noise at all
    clean = TopKGate(8, 6, top_k=2)
    clean.load_state_dict(a.state_dict())
    assert torch.equal(a(x).expert_index, clean(x).expert_index)


def test_low_precision_input_routes_in_float32():
    torch.manual_seed(5)
    gate = TopKGate(8, 4, top_k=2, z_loss_weight=1e-2).to(torch.bfloat16)
    r = gate(torch.randn(6, 8, dtype=torch.bfloat16))
    assert r.gate_weight.dtype == torch.float32 and r.aux_loss.dtype == torch.float32
    r.loss.backward()
    assert gate.router.weight.grad.dtype == torch.bfloat16


def test_empty_batch():
    r = TopKGate(8, 4, top_k=2)(torch.zeros(0, 8))
    assert r.expert_index.shape == (0, 2) and r.dropped == 0 and r.capacity == 1
    assert r.combine_weights().shape == (0, 4, 1)


# --- load statistics -------------------------------------------------------------------------


def test_load_stats():
    s = load_stats([5, 5, 5, 5])
    assert s["max_over_mean"] == 1.0 and s["cv"] == 0.0 and s["idle"] == 0 and s["total"] == 20
    s = load_stats(torch.tensor([1, 3]))
    assert s["max_over_mean"] == pytest.approx(1.5) and s["cv"] == pytest.approx(0.5)
    assert load_stats([0, 0])["max_over_mean"] == 1.0
    assert all(isinstance(v, (int, float)) for v in s.values())


# --- every error speaks to a student ---------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(aux_loss="foo"), r"aux_loss='foo' is not known; choose one of \['gshard', 'switch'\]"),
        (dict(top_k=5), "top_k=5 is larger than num_experts=4"),
        (dict(capacity_factor=0), "capacity_factor=0: a factor <= 0 is Tutel's spelling"),
        (dict(noise_std=-1.0), "noise_std must be a finite number >= 0"),
        (dict(z_loss_weight=-0.1), "z_loss_weight must be a finite number >= 0"),
        (dict(d_model=0), "d_model must be an int >= 1"),
        (dict(num_experts=0), "num_experts must be an int >= 1"),
    ],
)
def test_gate_constructor_errors(kwargs, match):
    args = dict(d_model=8, num_experts=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        TopKGate(**args)


def test_runtime_errors():
    gate = TopKGate(8, 4)
    with pytest.raises(ValueError, match=r"\(T, d_model=8\).*x.reshape\(-1, 8\)"):
        gate(torch.zeros(2, 3, 8))
    with pytest.raises(ValueError, match=r"d_model=8"):
        gate(torch.zeros(3, 7))
    r = gate(torch.randn(4, 8))
    with pytest.raises(ValueError, match="capacity must be an int >= 0"):
        r.with_capacity(-1)
    with pytest.raises(ValueError, match="int\\(tensor.item\\(\\)\\)"):
        r.with_capacity(torch.tensor(3))
    probs = torch.tensor(GOLDEN_PROBS)
    with pytest.raises(ValueError, match=r"Pass expert_index\[:, 0\]"):
        gshard_aux_loss(probs, torch.zeros(4, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="probs must be \\(tokens, experts\\)"):
        switch_aux_loss(probs[0], torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="logits must be \\(tokens, experts\\)"):
        router_z_loss(probs[0])
    with pytest.raises(ValueError, match="empty"):
        load_stats([])
    with pytest.raises(ValueError, match="counts must be >= 0"):
        load_stats([1, -1])


def test_routing_is_public_dataclass():
    r = TopKGate(8, 4)(torch.randn(4, 8))
    assert isinstance(r, Routing)
    assert (r.num_tokens, r.top_k, r.num_experts) == (4, 2, 4)


# --- where the capacity arithmetic departs from Tutel's (moe/capacity.py) -----------------------------
@pytest.mark.parametrize(
    "T, E, k, f, ours, tutels",
    [
        (10, 4, 2, 1.25, 7, 6),  # ceil(6.25) = 7; Tutel: 2 * int(1.25 * ceil(10/4) = 3.75) = 6
        (12, 8, 1, 1.5, 3, 3),  # ceil(2.25) = 3; Tutel: int(1.5 * 2) = 3
        (100, 8, 2, 1.0, 25, 26),  # ceil(25) = 25; Tutel: 2 * int(13) = 26 (T/E rounded up first)
    ],
)
def test_capacity_rounds_as_gshard_where_tutel_rounds_t_over_e_up_first(T, E, k, f, ours, tutels):
    from toolkit.moe.capacity import tutel_capacity

    assert (capacity(T, E, k, f), tutel_capacity(T, E, k, f)) == (ours, tutels)
    assert tutel_capacity(T, E, k, f, alignment=8) == -(-tutels // 8) * 8  # Tutel's alignment rounds up


def test_tutels_negative_capacity_factor_points_to_dynamic_capacity():
    from toolkit.moe import MoE

    with pytest.raises(
        ValueError,
        match=r"capacity_factor=-4.0: a factor <= 0 is Tutel's spelling of dynamic "
        r"capacity .*Here write dynamic_capacity=True, capacity_factor=4.0",
    ):
        MoE(8, 16, 4, capacity_factor=-4.0)
    layer = MoE(8, 16, 4, capacity_factor=4.0, dynamic_capacity=True)  # what the message says works
    assert layer.dynamic_capacity and layer.gate.capacity_factor == 4.0
