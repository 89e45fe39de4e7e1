"""Grouped-query attention (Ainslie et al. 2023; Llama 2 70B, Llama 3): n_kv_head key-value heads, each shared by
n_head/n_kv_head query heads.

- One process: the GPT's attention equals the computation written out by hand with each K and V head repeated
  for its group (transformers' `repeat_kv`), its parameters are what `gpt_parameter_split` counts, and a bad
  n_kv_head is refused in GPTConfig's words.
- Tensor parallelism (tp 2) splits the key-value heads with the query heads: a run trains as one process, and a
  number of key-value heads that does not split over tp is refused before training, naming n_kv_head and tp.
- Context parallelism (cp 2): ring attention (zigzag and contiguous) and Ulysses on compact K and V equal full
  attention with the heads repeated (output and gradients, fp64: to 1e-12), and training equals one process.
  The ring passes the compact K and V: 2(cp-1)/cp of them a layer, n_kv_head/n_head of what it passes without
  grouped-query attention, in the real run and in the simulator alike; Ulysses refuses key-value heads that do
  not split over cp, saying why.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from cp_rank_checks import groups_of, trained

import toolkit
from toolkit.memory import gpt_parameter_split, ring_bytes_per_layer
from toolkit.models import GPTConfig, tiny_gpt
from toolkit.models.gpt import repeat_kv
from toolkit.parallel.context import CPGroup, Ring, SequenceSplit, ring_attention, ulysses_attention
from toolkit.sim import simulate
from toolkit.train import TrainConfig, train

GQA = dict(n_layer=2, d_model=64, n_head=4, n_kv_head=2)
BASE = dict(steps=2, optimizer="sgd", lr=0.1, progress=False, model=GQA)
LOSS_ATOL, PARAM_ATOL = 1e-4, 1e-5  # tests/test_context_parallel.py's (derived in tests/test_pipeline.py)
CASES = [  # world 2
    ("tp", dict(BASE, strategy="local", global_batch_size=4, options={"tp": 2})),
    ("tp+sp", dict(BASE, strategy="local", global_batch_size=4, options={"tp": 2, "sequence_parallel": True})),
    ("ring", dict(BASE, strategy="ddp", global_batch_size=2, options={"cp": 2})),
    ("ulysses", dict(BASE, strategy="ddp", global_batch_size=2, options={"cp": 2, "cp_attention": "ulysses"})),
]


def test_attention_equals_the_hand_computation_with_each_kv_head_repeated_for_its_group():
    torch.manual_seed(0)
    model = tiny_gpt(**GQA)
    attn, x = model.blocks[0].attn, torch.randn(2, 16, 64, dtype=torch.float64)
    attn.double()
    w, b = attn.qkv.weight, attn.qkv.bias
    assert w.shape == (64 + 2 * 2 * 16, 64)  # q: 4 heads of 16; k and v: 2 heads each
    q, k, v = (x @ w[rows].T + b[rows] for rows in (slice(0, 64), slice(64, 96), slice(96, 128)))
    heads = []
    for head in range(4):
        group = head // 2  # query heads 0, 1 share key-value head 0; 2, 3 share head 1
        qh, kh, vh = (
            q[..., 16 * head : 16 * head + 16],
            k[..., 16 * group : 16 * group + 16],
            v[..., 16 * group :][..., :16],
        )
        scores = qh @ kh.transpose(-1, -2) / math.sqrt(16)
        scores = scores.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(scores.softmax(-1) @ vh)
    expected = torch.cat(heads, dim=-1) @ attn.proj.weight.T + attn.proj.bias
    assert (attn(x) - expected).abs().max() < 1e-12


def test_parameters_are_what_the_formula_counts_and_a_bad_group_is_refused():
    for fields in (GQA, dict(GQA, n_kv_head=1), dict(GQA, n_kv_head=None)):
        model = tiny_gpt(**fields)
        c = model.config
        counts = gpt_parameter_split(c.vocab_size, c.seq_len, c.n_layer, c.d_model, kv_hidden=c.kv_width)
        assert sum(counts.values()) == sum(p.numel() for p in model.parameters()), fields
    assert GPTConfig(n_head=4, d_model=64).n_kv_head == 4  # unset: one key-value head per query head
    with pytest.raises(ValueError, match=r"n_head=4 .* n_kv_head=3 .* valid n_kv_head for this n_head: \[1, 2, 4\]"):
        GPTConfig(n_head=4, d_model=64, n_kv_head=3)


def test_bad_key_value_heads_are_refused_before_training():
    with pytest.raises(
        ValueError, match=r"n_kv_head=1 of 'blocks.0.attn' does not split over tp=2.*multiple of 2 key-value heads"
    ):
        simulate(lambda: tiny_gpt(**dict(GQA, n_kv_head=1)), "local", 2, tp=2, progress=False)
    with pytest.raises(ValueError, match=r"Ulysses.*cannot split.*n_kv_head=1 key-value heads.*cp_attention='ring'"):
        simulate(lambda: tiny_gpt(**dict(GQA, n_kv_head=1)), "ddp", 2, cp=2, cp_attention="ulysses", progress=False)


def test_the_simulated_ring_passes_the_compact_keys_and_values():
    """Per layer and rank (cp 4, and cp 2 x tp 2): (cp-1)/cp of the compact K and V forward, twice that backward
    (fp32: 4 bytes forward, 4 + 4 with the gradient): half of what the same model passes with 4 key-value heads."""
    b, s, L = 2, 32, GQA["n_layer"]
    for cp, tp in ((4, 1), (2, 2)):
        sent = {}
        for kv in (2, 4):
            sim = simulate(
                functools.partial(tiny_gpt, **dict(GQA, n_kv_head=kv)),
                "ddp",
                4,
                rank=3,
                cp=cp,
                tp=tp,
                batch_per_rank=b,
                progress=False,
            )
            sent[kv] = {}
            for c in sim.collectives():
                if c.args.get("cp") in ("kv", "dkv"):
                    sent[kv][c.phase] = sent[kv].get(c.phase, 0) + c.bytes_sent
            assert sim.bytes_per_step["total"] == sim.theory()["bytes_per_step"], (cp, tp, kv)
        formula = ring_bytes_per_layer(b, s, 64, cp, tp=tp, bytes_per_value=4, kv_hidden=2 * 16)
        assert sent[2] == {"forward": L * formula["forward"], "backward": L * formula["backward"]}, (cp, tp)
        assert sent[2] == {phase: n // 2 for phase, n in sent[4].items()}, (cp, tp)


# --- real ranks: one launch at world 2 ------------------------------------------------------------------------------
def attention_errors() -> dict:
    """{variant: the largest difference, over the output and the gradients of q, k and v, between this rank's share
    of context-parallel attention (4 query heads, 2 key-value heads) and full attention with the heads repeated}."""
    group, found = groups_of(2), {}
    cp = CPGroup.of(group)
    torch.manual_seed(0)
    q, grad = (torch.randn(2, 4, 16, 8, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 2, 16, 8, dtype=torch.float64) for _ in range(2))
    for variant in ("ring", "ring-unbalanced", "ulysses"):
        split = SequenceSplit(cp.size, cp.rank, zigzag=variant == "ring")
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = F.scaled_dot_product_attention(full[0], repeat_kv(full[1], 4), repeat_kv(full[2], 4), is_causal=True)
        expected.backward(grad)
        mine = [split.local(t, dim=2).requires_grad_() for t in (q, k, v)]
        if variant == "ulysses":
            y = ulysses_attention(*mine, cp)
        else:
            y = ring_attention(*mine, Ring(group), split)
        y.backward(split.local(grad, dim=2))
        errors = [(y - split.local(expected.detach(), dim=2)).abs().max()]
        errors += [(a.grad - split.local(b.grad, dim=2)).abs().max() for a, b in zip(mine, full)]
        found[variant] = max(e.item() for e in errors)
    return found


def on_ranks() -> dict:
    return {"attention": attention_errors(), "trained": trained(CASES), "rank": dist.get_rank()}


@functools.cache
def launched():
    return toolkit.launch(on_ranks, 2, timeout_s=300, quiet=True)


@pytest.mark.timeout(400)
def test_context_parallel_attention_on_compact_keys_and_values_equals_full_attention(no_leftover_ranks):
    for found in launched():
        assert max(found["attention"].values()) < 1e-12, found["attention"]


@pytest.mark.timeout(400)
def test_tensor_and_context_parallel_runs_train_as_one_process(no_leftover_ranks):
    got = launched()
    for name, fields in CASES:
        torch.manual_seed(0)
        run, state = train(TrainConfig(**{**fields, "strategy": "local", "options": {}}), return_state=True)
        losses = [m["value"] for m in run.metrics if m["name"] == "loss"]
        mine = got[0]["trained"][name]
        assert max(abs(a - b) for a, b in zip(mine["losses"], losses)) <= LOSS_ATOL, (name, mine["losses"], losses)
        assert set(mine["state"]) == set(state), name
        worst = max((mine["state"][k] - state[k]).abs().max().item() for k in state)
        assert worst <= PARAM_ATOL, (name, worst)
    for rank, found in enumerate(got):  # the real ring sends what the simulator's does: the compact K and V
        sim = simulate(
            lambda: tiny_gpt(**GQA),
            "ddp",
            2,
            rank=rank,
            batch_per_rank=2,
            progress=False,
            optimizer=functools.partial(torch.optim.SGD, lr=0.1),
            cp=2,
        )
        assert sim.bytes_per_phase == found["trained"]["ring"]["bytes"], rank
