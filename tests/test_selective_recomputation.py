"""Megatron-LM's selective recomputation (`activation_checkpointing="attention"`, Korthikanti et al. 2022): every
block keeps its activations but those of its core attention (QKᵀ, softmax, its dropout, the product with V), which
backward recomputes from the Q, K and V it kept.

Counted exactly: with the attention kernels Megatron ran (`as_in_papers`, "megatron": the s x s scores stored) a
layer keeps the softmax's output, its dropout mask and its dropped-out copy less, the 5·a·s/h of Korthikanti's
s·b·h·(34 + 5·a·s/h), and backward runs QKᵀ again (torch's checkpoint stops before the product with V, whose inputs
it then holds); with a fused attention, which never stores the scores, only its log-sum-exp. The gradients are the
very same, dropout masks included, on one process and on tensor-parallel ranks (sequence parallelism, the masks of
each rank's heads from the tensor-parallel stream). The simulated rank runs the same code: no collective more, the
recomputed GEMMs priced.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import toolkit
from toolkit.memory import activation_terms, activations_by_module, pass_costs, tp_activation_bytes, tp_activation_terms
from toolkit.models import SyntheticCorpus, tiny_gpt
from toolkit.models.as_in_papers import as_in

SHAPE = dict(n_layer=3, d_model=32, n_head=2, seq_len=32)
BATCH = 4
TP_SHAPE = dict(n_layer=2, d_model=64, n_head=4, seq_len=32)


def gpt(kernels, **shape):
    torch.manual_seed(0)
    model = tiny_gpt(**shape)
    return as_in(model, kernels) if kernels else model


def one_pass(kernels, flag, **options) -> dict:
    """One forward and backward, training (the megatron style's dropout on): bytes kept, FLOPs, gradients."""
    model, _ = toolkit.parallel.wrap(gpt(kernels, **SHAPE), "local", activation_checkpointing=flag, **options)
    model.train()
    torch.manual_seed(1)  # the dropout masks
    cost = pass_costs(model, *SyntheticCorpus(64, SHAPE["seq_len"]).batch(0, BATCH))
    cost["grads"] = {name: p.grad.clone() for name, p in model.named_parameters()}
    return cost


def dropped(s, b, h, a, **switches) -> float:
    """Bytes a layer's terms lose when its core attention is recomputed."""
    kept = activation_terms(s, b, h, a, **switches)
    return sum(kept.values()) - sum(activation_terms(s, b, h, a, recompute_attention=True, **switches).values())


@pytest.mark.parametrize("kernels", ["megatron", None])
def test_the_scores_go_and_backward_runs_qk_again(kernels):
    L, h, a, s, b = SHAPE["n_layer"], SHAPE["d_model"], SHAPE["n_head"], SHAPE["seq_len"], BATCH
    stash, selective = one_pass(kernels, False), one_pass(kernels, "attention")
    if kernels == "megatron":  # fp32: the softmax's output (4 bytes), its dropout mask (1), its dropped-out copy (4)
        assert stash["kept"] - selective["kept"] == L * 9 * a * s * s * b == L * dropped(s, b, h, a, bytes_per_value=4)
        assert selective["backward"] - stash["backward"] == L * 2 * b * s * s * h  # QKᵀ once more per layer
    else:  # FlashAttention-style: no scores to drop, only the log-sum-exp (fp32); nothing counted recomputed on CPU
        switches = dict(bytes_per_value=4, dropout=False, fused_attention=True, small_terms=True)
        assert stash["kept"] - selective["kept"] == L * 4 * a * s * b == L * dropped(s, b, h, a, **switches)
    assert selective["forward"] == stash["forward"]
    assert selective["loss"] == stash["loss"]
    assert all(torch.equal(selective["grads"][n], g) for n, g in stash["grads"].items())


def test_korthikantis_equation_6_and_what_it_saves_gpt3():
    """With the core attention recomputed a layer keeps 34·s·b·h/t bytes under sequence parallelism (10 + 24/t
    without): for GPT-3 (a 96, s 2048, h 12288; 5as/h = 80) 70% less than storing it, the paper's figure."""
    s, h, a, t = 2048, 12288, 96, 8
    for sp, linear in ((True, 34 / t), (False, 10 + 24 / t)):
        assert tp_activation_bytes(s, 1, h, a, t, sequence_parallel=sp, recompute_attention=True) == s * h * linear
        terms = tp_activation_terms(s, 1, h, a, t, sequence_parallel=sp, recompute_attention=True)
        assert sum(terms.values()) == pytest.approx(s * h * linear, rel=1e-12)
    saved = 1 - 34 / (34 + 5 * a * s / h)
    assert 5 * a * s / h == 80 and round(saved, 2) == 0.70


def test_what_it_cannot_do_is_refused_in_the_options_words():
    with pytest.raises(ValueError, match='activation_checkpointing="attention" is not built for context parallelism'):
        toolkit.parallel.wrap(tiny_gpt(), "local", activation_checkpointing="attention", cp=2)
    blocks = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))  # repeated blocks, no attend(q, k, v)
    with pytest.raises(ValueError, match=r"modules with an attend\(q, k, v\) method .* Sequential has none"):
        toolkit.parallel.wrap(blocks, "local", activation_checkpointing="attention")
    with pytest.raises(ValueError, match=r'or "attention" \(every block\'s core attention'):
        toolkit.parallel.wrap(tiny_gpt(), "local", activation_checkpointing="attn")


# --- tensor parallelism with sequence parallelism, two gloo ranks ---------------------------------------
TP = dict(tp=2, sequence_parallel=True)


def tp_rank_passes():
    """On a tp 2 rank (Megatron's kernels, dropout on): per block bytes kept, and the gradients, stashed and
    selective."""
    found = {}
    for flag in (False, "attention"):
        model, _ = toolkit.parallel.wrap(gpt("megatron", **TP_SHAPE), "local", activation_checkpointing=flag, **TP)
        model.train()
        torch.manual_seed(1)
        x, y = SyntheticCorpus(64, TP_SHAPE["seq_len"]).batch(0, 2)
        per_block, _ = activations_by_module(model, model.module.blocks, x, y)
        torch.manual_seed(1)
        model.zero_grad()
        model(x, y).backward()
        found[flag] = (per_block, {name: p.grad.clone() for name, p in model.named_parameters()})
    return found


def fsdp_steps():
    """FSDP over both ranks (its units checkpoint their own core attention): the state after a step, both ways."""
    found = {}
    for flag in (False, "attention"):
        model, opt = toolkit.parallel.wrap(gpt("megatron", **TP_SHAPE), "fsdp", activation_checkpointing=flag)
        model.train()
        torch.manual_seed(1)
        x, y = SyntheticCorpus(64, TP_SHAPE["seq_len"]).batch(0, 4, rank=dist.get_rank(), world_size=2)
        kept = pass_costs(model, x, y)["kept"]
        opt.step()
        found[flag] = (kept, toolkit.parallel.full_state_dict(model))
    return found


def both_layouts():
    return {"tp": tp_rank_passes(), "fsdp": fsdp_steps()}


@functools.cache
def tp_runs():
    return toolkit.launch(both_layouts, 2, timeout_s=120, quiet=True)


@pytest.mark.timeout(200)
@pytest.mark.usefixtures("no_leftover_ranks")
def test_on_tensor_parallel_ranks_each_drops_its_heads_scores_and_the_masks_replay():
    L, h, a, s, t = TP_SHAPE["n_layer"], TP_SHAPE["d_model"], TP_SHAPE["n_head"], TP_SHAPE["seq_len"], 2
    per_rank = 9 * (a // t) * s * s * 2  # fp32 scores, mask, dropped-out copy of this rank's heads, batch 2
    terms = {flag: tp_activation_terms(s, 2, h, a, t, bytes_per_value=4, recompute_attention=flag) for flag in (0, 1)}
    assert sum(terms[0].values()) - sum(terms[1].values()) == per_rank
    for rank in tp_runs():
        (stash, stash_grads), (selective, grads) = rank["tp"][False], rank["tp"]["attention"]
        assert [x - y for x, y in zip(stash, selective)] == [per_rank] * L
        assert all(torch.equal(grads[n], g) for n, g in stash_grads.items())  # the tp stream's masks, replayed


@pytest.mark.timeout(200)
@pytest.mark.usefixtures("no_leftover_ranks")
def test_fsdp_units_recompute_their_core_attention_to_the_same_step():
    L, a, s = TP_SHAPE["n_layer"], TP_SHAPE["n_head"], TP_SHAPE["seq_len"]
    for rank in tp_runs():
        (stash_kept, stash), (kept, selective) = rank["fsdp"][False], rank["fsdp"]["attention"]
        assert stash_kept - kept == L * 9 * a * s * s * 2  # every unit's scores, mask, dropped-out scores: 2 rows
        assert all(torch.equal(selective[k], v) for k, v in stash.items())


def test_the_simulated_rank_sends_the_same_and_prices_the_recomputed_attention():
    """GPT-3's width, tp 8 with sequence parallelism, Megatron's kernels, four layers: selective recomputation adds
    no collective (full recomputation repeats the forward's), keeps far less at the peak, and costs a small part of
    what recomputing whole blocks costs."""
    from toolkit.models import presets
    from toolkit.sim import simulate

    def run(flag):
        return simulate(
            lambda: as_in(presets.gpt3_175b(n_layer=4), "megatron"),
            "local",
            8,
            batch_per_rank=1,
            tp=8,
            sequence_parallel=True,
            mixed_precision=True,
            activation_checkpointing=flag,
            progress=False,
            warmup=False,
            cluster="dgx-a100",
        )

    sims = {flag: run(flag) for flag in (False, True, "attention")}
    assert sims["attention"].bytes_per_step == sims[False].bytes_per_step != sims[True].bytes_per_step
    L, s, h, a, t = 4, 2048, 12288, 96, 8
    # at the end of the forward, each layer holds its 16-bit scores, mask and dropped-out scores less: Korthikanti's
    # 5·a·s²·b/t, the term equation 6 takes away, to the byte
    end = {flag: sim.moments[("forward", "forward", "(model)", 1)]["activations"] for flag, sim in sims.items()}
    term = tp_activation_bytes(s, 1, h, a, t, sequence_parallel=True) - tp_activation_bytes(
        s, 1, h, a, t, sequence_parallel=True, recompute_attention=True
    )
    assert end[False] - end["attention"] == L * 5 * a * s * s / t == L * term
    assert end[True] < end["attention"]
    # the recomputed QKᵀ: 2·b·s²·h per layer (on a rank, /t), exactly
    assert sims["attention"].flops - sims[False].flops == L * 2 * s * s * h / t
    step = {flag: sim.step_time for flag, sim in sims.items()}
    assert step[False] < step["attention"] < step[False] + (step[True] - step[False]) / 4, step
