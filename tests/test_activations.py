"""Activation memory: Korthikanti et al.'s per-layer formula, term by term, against what autograd really
saves in the tiny GPT; and activation checkpointing (FSDP's `activation_checkpointing=True`): the bytes
it saves and the computation it pays, both counted exactly.
"""

from __future__ import annotations

import functools

import pytest
import torch

import toolkit
from toolkit.memory import activation_bytes, activation_terms, activations_by_module
from toolkit.models import SyntheticCorpus, tiny_gpt

SHAPES = [  # (n_layer, hidden, heads, seq_len, batch)
    (2, 32, 2, 32, 4),
    (1, 48, 3, 16, 2),
]
CKPT = dict(n_layer=3, d_model=32, n_head=2)  # FSDP: one unit per block, 3 checkpointed blocks
CKPT_BATCH = 8  # rows over both ranks (4 each), sequence 32


def tiny_gpt_terms(s, b, h, a, dtype) -> dict:
    """The tiny GPT: no dropout, torch's fused attention, every small term counted too."""
    return activation_terms(
        s, b, h, a, bytes_per_value=torch.finfo(dtype).bits // 8, dropout=False, fused_attention=True, small_terms=True
    )


def test_the_terms_add_up_to_the_papers_formula():
    for s, b, h, a in ((2048, 1, 12288, 96), (512, 8, 1024, 16), (32, 4, 32, 2)):
        assert sum(activation_terms(s, b, h, a).values()) == activation_bytes(s, b, h, a)
        assert activation_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_tiny_gpt_saves_exactly_what_the_terms_say(shape, dtype):
    """Measured per block from the tensors autograd saves; the paper's own formula misses by its
    assumptions (16-bit, dropout masks, s x s scores stored), which the terms switch off one by one."""
    L, h, a, s, b = shape
    torch.manual_seed(0)
    model = tiny_gpt(n_layer=L, d_model=h, n_head=a, seq_len=s).to(dtype)
    x, y = SyntheticCorpus(64, s).batch(0, b)
    per_block, total = activations_by_module(model, model.blocks, x, y)
    want = sum(tiny_gpt_terms(s, b, h, a, dtype).values())
    assert per_block == [want] * L
    assert total > L * want  # embeddings, final LayerNorm, the head's logits: outside the blocks
    # the paper's linear part, 34·sbh at 16 bits, less its 2·sbh of dropout masks: what the blocks keep
    # at 16 bits in matmul inputs, LayerNorm inputs, Q/K/V, GELU (everything but the small terms)
    big = {k: v for k, v in tiny_gpt_terms(s, b, h, a, dtype).items() if "mean" not in k and "log-sum" not in k}
    assert sum(big.values()) == (34 - 2) * s * b * h * (torch.finfo(dtype).bits // 16)


# --- stashing against checkpointing, under FSDP on two ranks --------------------------------------------
def stash_or_recompute(checkpointing: bool | int) -> dict:
    """One FSDP step: activation bytes kept from forward to backward, FLOPs of each pass, final state."""
    import torch.distributed as dist

    from toolkit.memory import pass_costs
    from toolkit.parallel import full_state_dict, wrap

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model, opt = wrap(
        tiny_gpt(**CKPT),
        "fsdp",
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
        activation_checkpointing=checkpointing,
    )
    x, y = SyntheticCorpus().batch(0, CKPT_BATCH, rank=rank, world_size=world)
    cost = pass_costs(model, x, y)
    opt.step()
    of = lambda suffix: next(n for name, n in cost["by_module"].items() if name.endswith(suffix))  # noqa: E731
    return {**cost, "block": of(".blocks.0"), "last_matmul": of(".blocks.0.mlp.proj"), "state": full_state_dict(model)}


def both():
    return {c: stash_or_recompute(c) for c in (False, True, 2)}  # 2: every second block (fms-fsdp's selective)


@functools.cache
def checkpointing_runs():
    return toolkit.launch(both, 2, timeout_s=60)


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("no_leftover_ranks")
def test_checkpointing_keeps_only_each_blocks_input_and_recomputes_its_forward():
    h, s, L = CKPT["d_model"], 32, CKPT["n_layer"]
    b = CKPT_BATCH // 2
    per_block = sum(tiny_gpt_terms(s, b, h, CKPT["n_head"], torch.float32).values())
    for rank in checkpointing_runs():
        stash = rank[False]
        for k, blocks in ((True, L), (2, L // 2)):  # every block; every second one (of 3: the middle one)
            ckpt = rank[k]
            # memory: each checkpointed block keeps its input (4·sbh bytes) instead of everything its operations saved
            assert stash["kept"] - ckpt["kept"] == blocks * (per_block - 4 * s * b * h), k
            # compute: the same forward; backward runs each checkpointed block's forward again, up to the last
            # tensor it needs (torch stops before the MLP's output matmul, whose result backward never reads)
            assert ckpt["forward"] == stash["forward"]
            assert ckpt["backward"] - stash["backward"] == blocks * (stash["block"] - stash["last_matmul"]), k
            # and the arithmetic is the same: recomputation gives back the very tensors stashing kept
            assert ckpt["loss"] == stash["loss"]
            assert all(torch.equal(ckpt["state"][k_], stash["state"][k_]) for k_ in stash["state"])


def test_checkpointing_gathers_zero3s_modules_again_in_backward_and_fsdps_units_not():
    """The recomputation runs each checkpointed block's forward again inside backward. ZeRO-3 (a unit per module,
    freed after each use) gathers those modules a third time, but those still gathered when their backward comes;
    FSDP keeps a unit gathered through its whole backward, recomputation included. The reduce-scatters do not
    change. (Simulated rank of two: the bytes equal a real gloo run's, tests/test_sim_vs_real.py.)"""
    from toolkit.parallel.fsdp_policy import default_units
    from toolkit.sim import simulate

    make = functools.partial(tiny_gpt, n_layer=2, d_model=64, n_head=4)
    model = make()
    names, _ = default_units(model)
    modules = dict(model.named_modules())
    blocks = sum(p.numel() for name in names for p in modules[name].parameters())
    sent = {
        (strategy, ac): simulate(
            make, strategy, 2, progress=False, steps=1, warmup=False, activation_checkpointing=ac
        ).bytes_per_step
        for strategy in ("zero3", "fsdp")
        for ac in (False, True)
    }
    again = sent["zero3", True]["all_gather"] - sent["zero3", False]["all_gather"]
    assert 0 < again < blocks * 4 / 2, (again, blocks)  # some of the blocks' parameters, once more, half sent
    assert sent["zero3", True]["reduce_scatter"] == sent["zero3", False]["reduce_scatter"]
    assert sent["fsdp", True] == sent["fsdp", False]


def test_checkpointing_by_operation_keeps_what_is_dear_to_recompute():
    """activation_checkpointing="op" (torchtitan's selective op checkpointing, `checkpoint_ops.py`): every block keeps
    its attention's output and every other matmul's, and recomputes the rest. On a simulated rank of GPT-3 (four
    layers at its width, fsdp over 512): activations at the peak between stashing and checkpointing every block, and
    the recomputation costs under a quarter of what whole-block checkpointing adds (the cheap operations and the
    matmuls backward needs again)."""
    from toolkit.models import presets
    from toolkit.sim import simulate

    sims = {
        flag: simulate(
            lambda: presets.gpt3_175b(n_layer=4),
            "fsdp",
            512,
            mixed_precision=True,
            progress=False,
            warmup=False,
            activation_checkpointing=flag,
        )
        for flag in (False, True, "op")
    }
    kept = {flag: sim.peak_memory["activations"] for flag, sim in sims.items()}
    assert kept[True] < kept["op"] < kept[False], kept
    stashed, whole, by_operation = (sims[flag].flops for flag in (False, True, "op"))
    assert stashed < by_operation < stashed + (whole - stashed) / 4, (stashed, by_operation, whole)
