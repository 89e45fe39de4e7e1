"""Tensor parallelism trains exactly what one process trains: losses per step and final parameters.

Every layout runs the toolkit's own training loop (`toolkit.train.train`) inside one launch per world size;
the one-process references run here, in the test's process. The MoE GPT's reference accumulates t
micro-batches (under tp the ranks of a group share out the tokens, each routing its own rows with its own
capacity, as `tensor/moe.py` says), the dense ones take the whole batch at once.

Tolerances, fp32 (unit roundoff u = 2^-24 = 6e-8). A layout changes only the order of sums: the row-parallel
outputs add t partial sums, the embedding adds t partial lookups, the cross-entropy's log-sum-exp adds
V = 64 exponentials in t groups, data parallelism averages dp gradients. A sum of n terms computed in
another order moves by at most about n·u times the sum of its terms' magnitudes.
- Loss (about 4.2): the log-sum-exp over V = 64 terms: |Δ| <= 64 · u · 4.2 = 1.6e-5 -> LOSS_ATOL = 2e-5.
- Parameters: a gradient element sums the contributions of the b·s = 256 tokens of a batch, whose
  magnitudes add up to less than 1 here (the whole gradient's norm is below 1), so |Δg| <= 256 · u = 1.5e-5;
  SGD at lr 0.1 moves a parameter by lr·Δg per step; over two steps, with momentum 0.9, by at most
  lr·(1 + 1.9)·Δg: |Δθ| <= 0.29 · 1.5e-5 = 4.4e-6 -> PARAM_ATOL = 1e-5. A collective left out moves
  a parameter by lr·|g|, 1e-3 and more: far outside.
- Mixed precision (bf16 compute, fp32 masters), against "local" with the same recipe: the reference's loss is a
  bf16 number near 4 (spacing 1/32) whose log-softmax ran in bf16, the vocabulary-parallel loss runs in fp32:
  MP_LOSS_ATOL = 3/32 (as tests/test_zero.py). Gradients are bf16 (relative spacing 2^-8) on both sides and
  round differently: |Δg| <= 2 · 2^-8 · G with G = 0.30 the largest gradient element of this model's first
  step, so two SGD steps at lr 0.1 differ by at most 0.1 · 2 · 2 · 2^-8 · 0.30 = 4.7e-4 -> MP_PARAM_ATOL = 5e-4.
"""

from __future__ import annotations

import functools

import foreign_models as fm
import pytest
import torch
import torch.distributed as dist
from tp_rank_checks import SGD, norm_of_ones, overflow_on_one_rank, wrapped_mesh

import toolkit
from toolkit.models import SyntheticCorpus
from toolkit.train import TrainConfig, moe_model_fn, train

LOSS_ATOL, PARAM_ATOL = 2e-5, 1e-5
MP_LOSS_ATOL, MP_PARAM_ATOL = 3 / 32, 5e-4
BASE = dict(steps=2, global_batch_size=8, optimizer="sgd", lr=0.1, progress=False, sample_memory=False)
MOE = dict(num_experts=4, top_k=2, capacity_factor=2.0)
ENCODER_PLAN = {
    "encoder.layers.*.linear1": "colwise",
    "encoder.layers.*.linear2": "rowwise",
    "embed": "vocab",
    "head": "vocab",
}
GPT2_PLAN = {
    "transformer.h.*.mlp.c_fc": "colwise",
    "transformer.h.*.mlp.c_proj": "rowwise",
    "transformer.wte": "vocab",
    "lm_head": "vocab",
}

# (name, TrainConfig fields, model_fn, the reference's fields): world 2 = tp 2; world 4 = dp 2 x tp 2
CASES = {
    2: [
        ("tp", dict(strategy="local", options={"tp": 2}), None, {}),
        ("tp+sp", dict(strategy="local", options={"tp": 2, "sequence_parallel": True}), None, {}),
        ("moe tp", dict(strategy="local", options={"tp": 2}), "moe", dict(accumulation=2)),
        ("encoder tp_plan", dict(strategy="local", options={"tp": 2, "tp_plan": ENCODER_PLAN}), "encoder", {}),
        (
            "tp bf16",
            dict(strategy="local", options={"tp": 2, "mixed_precision": True}),
            None,
            dict(options={"mixed_precision": True}),
        ),
    ],
    4: [
        ("fsdp x tp", dict(strategy="fsdp", clip=0.05, options={"tp": 2}), None, dict(clip=0.05)),
        (
            "zero1 x tp+sp",
            dict(strategy="zero1", clip=0.05, options={"tp": 2, "sequence_parallel": True}),
            None,
            dict(clip=0.05),
        ),
        ("ddp x tp moe", dict(strategy="ddp", clip=0.05, options={"tp": 2}), "moe", dict(accumulation=4, clip=0.05)),
        (
            "zero3 x tp, checkpointed",
            dict(strategy="zero3", options={"tp": 2, "activation_checkpointing": True}),
            None,
            {},
        ),
    ],
}


def model_fn(kind):
    if kind == "moe":
        return moe_model_fn(**MOE)
    if kind == "encoder":
        return lambda config: fm.EncoderLM()
    return None


def reference(fields, kind):
    return train(TrainConfig(**{**BASE, "strategy": "local", **fields}), model_fn=model_fn(kind), return_state=True)


def gpt2_steps(tp: int):
    """Hugging Face GPT-2 with a tp_plan (keyword forward, an output object, Conv1D weights stored (in, out))."""
    model = fm.gpt2_lm()
    if tp > 1:
        model, opt = toolkit.parallel.wrap(model, "local", optimizer=SGD, tp=tp, tp_plan=GPT2_PLAN)
    else:
        opt = SGD(model.parameters())
    corpus, losses = SyntheticCorpus(vocab_size=fm.VOCAB, seq_len=fm.SEQ), []
    for step in range(2):
        loss = fm.gpt2_loss(model, *corpus.batch(step, 8))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in toolkit.parallel.full_state_dict(model).items()}


def layouts(cases, with_gpt2, directory):
    if dist.get_world_size() == 4:
        found = {
            "checkpoints": checkpoints_across_layouts(directory),
            "mesh": wrapped_mesh(),
            "fp16 vote, zero2 x tp": overflow_on_one_rank("zero2"),
            "norm of ones": {name: norm_of_ones(*case) for name, case in NORM_CASES.items()},
        }
    else:
        found = {"fp16 vote": overflow_on_one_rank()}
    for name, fields, kind, _ in cases:
        torch.manual_seed(0)
        run, state = train(TrainConfig(**{**BASE, **fields}), model_fn=model_fn(kind), return_state=True)
        found[name] = ([m["value"] for m in run.metrics if m["name"] == "loss"], state)
    if with_gpt2:
        found["gpt2 tp_plan"] = gpt2_steps(2)
    return found if dist.get_rank() == 0 else None


# Clipping under dp x tp: with every gradient element set to 1 wherever it lies, a norm that counts each element
# once is exactly sqrt(Ψ) (an fp32 sum of Ψ < 2^24 ones is exact); a replicated parameter counted on both tp
# ranks, or a dp replica's copy counted again, or a slice left out, moves it by whole elements.
NORM_CASES = {
    "ddp x tp": ("ddp", {"tp": 2}, None),
    "zero1 x tp+sp": ("zero1", {"tp": 2, "sequence_parallel": True}, None),
    "fsdp x tp": ("fsdp", {"tp": 2}, None),
    "zero3 x tp": ("zero3", {"tp": 2}, None),
    "ddp x tp moe": ("ddp", {"tp": 2}, functools.partial(model_fn("moe"), TrainConfig(**BASE))),
}


def compare(name, got, expected):
    (losses, state), (ref_losses, ref_state) = got, expected
    loss_atol, param_atol = (MP_LOSS_ATOL, MP_PARAM_ATOL) if "bf16" in name else (LOSS_ATOL, PARAM_ATOL)
    assert set(state) == set(ref_state), (name, set(state) ^ set(ref_state))
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= loss_atol, (name, losses, ref_losses)
    worst = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
    assert worst <= param_atol, (name, worst)


@functools.cache
def launched(world: int, directory: str):
    try:
        import transformers  # noqa: F401

        with_gpt2 = world == 2
    except ImportError:
        with_gpt2 = False
    return toolkit.launch(layouts, world, args=(CASES[world], with_gpt2, directory), timeout_s=360, quiet=True)[0]


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tp-checkpoints"))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_layouts_train_as_one_process(world, directory, no_leftover_ranks):
    got = launched(world, directory)
    for name, _, kind, ref_fields in CASES[world]:
        run, state = reference(ref_fields, kind)
        compare(name, got[name], ([m["value"] for m in run.metrics if m["name"] == "loss"], state))
    # every rank skipped (only the last saw an inf), nothing moved, the scale halved from 2^16
    for vote in ("fp16 vote",) if world == 2 else ("fp16 vote, zero2 x tp",):
        assert got[vote] == [(True, True, 2.0**15)] * world, (vote, got[vote])
    if world == 4:
        assert got["mesh"] == (True, ("dp", "pp", "cp", "tp"), (2, 1, 1, 2))
        for name, (norm, psi, after) in got["norm of ones"].items():
            # exact but for the fp32 square root's rounding (2^-24 relative); one element more or less: 1/(2Ψ)
            assert abs(norm - psi**0.5) <= 2**-23 * psi**0.5 < psi**0.5 / (2 * psi), (name, norm, psi)
            assert after == {round(1 / (psi**0.5 + 1e-6), 6)}, (name, after)


@pytest.mark.timeout(400)
def test_hugging_face_gpt2_with_a_tp_plan_trains_as_one_process(directory, no_leftover_ranks):
    """GPT-2's Conv1D stores its weight (in, out): "colwise" splits its second dimension (run in the world-2 launch)."""
    pytest.importorskip("transformers", reason="Hugging Face transformers is not installed: pip install -e '.[hf]'")
    got = launched(2, directory)["gpt2 tp_plan"]
    torch.manual_seed(0)
    compare("gpt2 tp_plan", got, gpt2_steps(1))


# --- checkpoints across (dp, tp) layouts ------------------------------------------------------------------
CKPT_MODEL = dict(n_layer=2, d_model=32, n_head=4)  # 4 heads: tp 4 fits
ADAM = functools.partial(torch.optim.AdamW, lr=1e-2)
LOADERS = [("ddp", {}), ("local", {"tp": 4}), ("zero2", {"tp": 2, "sequence_parallel": True}), ("fsdp", {"tp": 2})]


def checkpoints_across_layouts(directory):
    """Train zero1 at dp 2 x tp 2 and save; load into every other layout of 4 ranks and save again."""
    import os

    from toolkit.parallel.checkpoint import load_full, save_full

    rank = dist.get_rank()
    torch.manual_seed(0)
    model, opt = toolkit.parallel.wrap(toolkit.models.tiny_gpt(**CKPT_MODEL), "zero1", optimizer=ADAM, tp=2)
    corpus = SyntheticCorpus()
    for step in range(2):
        x, y = corpus.batch(step, 8, rank=rank // 2, world_size=2)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    first = os.path.join(directory, "dp2-tp2.pt")
    save_full(model, opt, first)
    saved = toolkit.parallel.full_state_dict(model)
    found = {}
    for strategy, options in LOADERS:
        torch.manual_seed(1)  # other initial values: only the checkpoint can make them equal
        other, other_opt = toolkit.parallel.wrap(
            toolkit.models.tiny_gpt(**CKPT_MODEL), strategy, optimizer=ADAM, **options
        )
        load_full(other, other_opt, first)
        again = os.path.join(directory, f"{strategy}-{options.get('tp', 1)}.pt")
        save_full(other, other_opt, again)
        state = toolkit.parallel.full_state_dict(other)
        found[(strategy, options.get("tp", 1))] = (all(torch.equal(state[k], saved[k]) for k in saved), again)
    return first, {k: v.cpu() for k, v in saved.items()}, found


def _same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.timeout(400)
def test_checkpoints_move_between_dp_tp_layouts_bit_for_bit(directory, no_leftover_ranks):
    from toolkit.parallel.checkpoint import load_full, save_full

    first, saved, found = launched(4, directory)["checkpoints"]
    original = torch.load(first, weights_only=True)
    for (strategy, tp), (params_equal, again) in found.items():
        assert params_equal, (strategy, tp)  # loaded: the full parameters, bit for bit
        assert _same(torch.load(again, weights_only=True), original), (strategy, tp)  # and saved back unchanged
    # tp 1 in one process: the file does not know it came from a tensor-parallel run
    torch.manual_seed(1)
    model, opt = toolkit.parallel.wrap(toolkit.models.tiny_gpt(**CKPT_MODEL), "local", optimizer=ADAM)
    load_full(model, opt, first)
    assert all(torch.equal(toolkit.parallel.full_state_dict(model)[k], v) for k, v in saved.items())
    save_full(model, opt, first + ".local")
    assert _same(torch.load(first + ".local", weights_only=True), original)


def test_activation_checkpointing_is_an_option_of_every_strategy():
    """Not only FSDP's: here "local", in this process. The blocks keep their inputs only, and backward
    pays their forward again; the gradients are the same. A whole number k checkpoints every k-th block; "op" every
    block by operation."""
    from toolkit.memory import pass_costs

    costs = {}
    for flag in (False, True, 2, "op"):
        torch.manual_seed(0)
        model, _ = toolkit.parallel.wrap(toolkit.models.tiny_gpt(n_layer=4), "local", activation_checkpointing=flag)
        costs[flag] = pass_costs(model, *SyntheticCorpus().batch(0, 4))
        costs[flag]["grads"] = [p.grad.clone() for p in model.parameters()]
    plain, checkpointed, half = costs[False], costs[True], costs[2]
    assert checkpointed["kept"] < plain["kept"] / 2
    assert checkpointed["backward"] > plain["backward"]  # the recomputed forwards
    # every second block (2 and 4 of 4): half the saving, half the recomputation
    assert plain["kept"] - half["kept"] == (plain["kept"] - checkpointed["kept"]) / 2
    assert half["backward"] - plain["backward"] == (checkpointed["backward"] - plain["backward"]) / 2
    # by operation: the matmuls' and attention's outputs kept (but every second matmul's), the rest recomputed
    assert plain["backward"] < costs["op"]["backward"] < half["backward"]
    for got in (checkpointed, half, costs["op"]):
        assert all(torch.equal(a, b) for a, b in zip(plain["grads"], got["grads"]))
    with pytest.raises(ValueError, match='activation_checkpointing="op" is not built for tensor or context'):
        toolkit.parallel.wrap(toolkit.models.tiny_gpt(), "local", activation_checkpointing="op", tp=2)
    for wrong in ("yes", 0, -2, 1.5, "ops"):
        for strategy in ("local", "fsdp"):  # fsdp's is its own option: refused before it asks for ranks
            with pytest.raises(ValueError, match=r"activation_checkpointing must be True \(every block\), False"):
                toolkit.parallel.wrap(toolkit.models.tiny_gpt(), strategy, activation_checkpointing=wrong)


@pytest.mark.timeout(300)
def test_launch_train_takes_tensor_parallel_options_and_the_global_batch_stays_global(no_leftover_ranks):
    """`launch_train(TrainConfig(options={"tp": 2}), 2)`: the two ranks are one replica holding the whole global
    batch of 8 rows, so the run is one process's on those rows, and both ranks record the same losses."""
    from toolkit.train import launch_train

    config = TrainConfig(**{**BASE, "strategy": "local", "options": {"tp": 2}})
    run, state = launch_train(config, 2, return_state=True, quiet=True, timeout_s=240)
    ref_run, ref_state = reference({}, None)
    per_rank = [[m["value"] for m in run.metrics if m["name"] == "loss" and m["rank"] == r] for r in (0, 1)]
    assert per_rank[0] == per_rank[1]
    compare(
        "launch_train tp",
        (per_rank[0], state),
        ([m["value"] for m in ref_run.metrics if m["name"] == "loss"], ref_state),
    )
