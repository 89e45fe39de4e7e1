"""Any model a student brings, under every strategy: models the toolkit did not write train exactly as the
one-process run does.

- torch's own nn.TransformerEncoder as a causal LM (tests/foreign_models.py): a head tied to the
  embedding, a buffer (the causal mask), a layer called twice per forward, and nn.MultiheadAttention,
  whose forward reads its out_projection's weight without calling it.
- Hugging Face's GPT2LMHeadModel built from a config (nothing downloaded): a forward that takes keyword
  arguments and returns an output object. Needs the optional extra `pip install -e .[hf]`.

One launch of 2 ranks per model runs the one-process reference and every strategy (2 SGD steps each)
and compares the full parameters. FSDP's default wrap policy must choose the models' repeated layers
and say so in the Run."""

import functools
import importlib.util

import foreign_models as fm
import pytest
import torch
import torch.nn as nn

import toolkit
from toolkit.parallel import STRATEGIES
from toolkit.parallel.fsdp_policy import default_units, select

STEPS = 2
OPTIMIZER = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def every_strategy(which: str):
    import torch.distributed as dist

    from toolkit.models import SyntheticCorpus
    from toolkit.parallel import full_state_dict, wrap
    from toolkit.trace.events import recorder

    build, loss = {"encoder": (fm.encoder_lm, fm.encoder_loss), "gpt2": (fm.gpt2_lm, fm.gpt2_loss)}[which]
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = SyntheticCorpus(vocab_size=fm.VOCAB, seq_len=fm.SEQ)
    reference = build()
    ref_opt = OPTIMIZER(reference.parameters())
    for step in range(STEPS):
        loss(reference, *corpus.batch(step, 8)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    expected = {n: p.detach() for n, p in reference.named_parameters()}
    diffs = {}
    for strategy in STRATEGIES:
        model, opt = wrap(build(), strategy, optimizer=OPTIMIZER)
        for step in range(STEPS):
            x, y = corpus.batch(step, 8) if strategy == "local" else corpus.batch(step, 8, rank=rank, world_size=world)
            loss(model, x, y).backward()
            opt.step()
            opt.zero_grad()
        got = full_state_dict(model)
        assert set(got) == set(expected), (strategy, set(got) ^ set(expected))
        diffs[strategy] = max((got[n].float() - v).abs().max().item() for n, v in expected.items())
    refused = []
    if which == "encoder":  # a parent reading its child's weight: zero3 must say so, not crash obscurely
        for parent in (fm.ReadsChildWeight(), fm.ScalesByChildWeight()):  # the forward fails; it computes
            try:
                model, _ = wrap(parent, "zero3", optimizer=OPTIMIZER)
                model(torch.randn(2, 4)).backward()
            except RuntimeError as exc:
                refused.append(str(exc))
    policy = [m["value"] for m in recorder.metrics if m["name"] == "fsdp/wrap_policy"]
    return diffs, policy, refused


@pytest.mark.timeout(180)
def test_torch_transformer_encoder_lm_trains_the_same_under_every_strategy(no_leftover_ranks):
    diffs, policy, refused = toolkit.launch(every_strategy, 2, args=("encoder",))[0]
    assert set(diffs) == set(STRATEGIES)
    assert max(diffs.values()) < 1e-5, diffs  # fp32: only the order of the sums differs
    assert policy == [
        "wrap_policy=None (the default): the model's repeated layers, one unit each: "
        "encoder.layers (2 x TransformerEncoderLayer), plus the root for the rest"
    ]
    assert len(refused) == 2, refused
    for said in refused:
        assert "read a parameter at another time" in said and "Use fsdp" in said, said
    assert "['child'] did not run" in refused[0] and "'child.weight' got a gradient" in refused[1], refused


@pytest.mark.timeout(180)
def test_hugging_face_gpt2_trains_the_same_under_every_strategy(no_leftover_ranks):
    pytest.importorskip(
        "transformers",
        reason="Hugging Face transformers is not installed: pip install -e '.[hf]' "
        "(make setup installs it) to run the GPT-2 any-model test",
    )
    diffs, policy, _ = toolkit.launch(every_strategy, 2, args=("gpt2",))[0]
    assert max(diffs.values()) < 1e-5, diffs
    assert policy == [
        "wrap_policy=None (the default): the model's repeated layers, one unit each: "
        "transformer.h (2 x GPT2Block), plus the root for the rest"
    ]


def test_default_wrap_policy_fits_any_model_and_a_policy_that_matches_nothing_is_refused():
    from toolkit.models import tiny_gpt

    assert default_units(tiny_gpt())[0] == ["blocks.0", "blocks.1"]
    assert default_units(fm.encoder_lm())[0] == ["encoder.layers.0", "encoder.layers.1"]
    stack = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 2)))
    assert default_units(stack)[0] == []  # children of different classes: no repeated layers
    assert default_units(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)))[0] == ["0", "2"]
    units, why = default_units(nn.Linear(3, 3))
    assert units == [] and "the root alone" in why and "still sharded" in why
    with pytest.raises(ValueError, match="matched no module"):
        select(fm.encoder_lm(), nn.Conv2d)


# --- Hugging Face models as they come: the slice of tests/test_hf_models.py that make test runs --------------------
hf = pytest.mark.skipif(  # found, not imported: collecting this file costs a worker no transformers import (2 CPU s)
    importlib.util.find_spec("transformers") is None,
    reason="Hugging Face transformers is not installed: pip install -e '.[dev]' (make setup installs it)",
)


@hf
def test_each_hugging_face_model_is_recognised_by_its_calling_convention():
    from toolkit.models.protocol import recognise

    kinds = {name: recognise(fm.hf_model(name)).name for name in fm.HF_MODELS}
    assert kinds == {
        "gpt2": "causal-lm",
        "llama": "causal-lm",
        "mixtral": "causal-lm",
        "qwen2_moe": "causal-lm",
        "bert": "masked-lm",
        "vit": "image-classification",
    }
    assert recognise(fm.encoder_lm()).name == "toolkit"  # forward(x, y) -> loss
    model = fm.hf_model("bert")
    data = recognise(model).data(model, vocab_size=fm.VOCAB, seq_len=fm.SEQ)
    x, y = data.batch(0, 4)
    masked = y != -100
    assert (masked.sum(1) == round(0.15 * fm.SEQ)).all()  # the same count in every row: ranks average exactly
    assert (x[masked] == model.config.vocab_size - 1).all() and (x[~masked] < fm.VOCAB).all()
    assert torch.equal(torch.cat([data.batch(0, 4, rank=r, world_size=2)[1] for r in range(2)]), y)
    from transformers import BertForSequenceClassification

    with pytest.raises(ValueError, match="neither a causal nor a masked language model.*Pass loss_fn"):
        recognise(BertForSequenceClassification(fm.hf_config("bert")))
    custom = recognise(model, loss_fn=lambda m, x, y: m(input_ids=x).logits.mean())
    assert custom.name == "custom" and "loss_fn" in custom.why


def hf_layouts_and_deferred_init():
    """Llama through ddp, fsdp, tp (its own plan) and pp (split automatically), held to plain torch; then built on
    meta and wrapped by fsdp with the model's own init: parameters and buffers as the model's own init gives them."""
    import hf_matrix
    import torch.distributed as dist

    from toolkit.parallel import full_state_dict, wrap
    from toolkit.parallel.fsdp_init import initialize, own_init

    rows = [r for r in hf_matrix.layouts("llama", 2) if r[0] in ("ddp", "fsdp", "tp", "pp")]
    diffs = {k: v for k, v in hf_matrix.train_rows("llama", rows).items() if not k.endswith(("convention", "moe"))}
    with torch.device("meta"):
        deferred = fm.hf_model("llama")
    model, _ = wrap(deferred, "fsdp", optimizer=OPTIMIZER, param_init_fn=own_init(deferred, seed=3))
    expected = initialize(fm.hf_model("llama"), own_init(fm.hf_model("llama"), seed=3))
    got = full_state_dict(model)
    init = max((got[n] - p).abs().max().item() for n, p in expected.named_parameters())
    buffers = {n: b for n, b in model.module.named_buffers()}
    same_buffers = all(torch.equal(buffers[n], b) for n, b in fm.hf_model("llama").named_buffers())
    return (diffs, init, same_buffers) if dist.get_rank() == 0 else None


@hf
@pytest.mark.timeout(240)
def test_a_hugging_face_llama_trains_as_plain_torch_and_inits_deferred(no_leftover_ranks):
    diffs, init, same_buffers = toolkit.launch(hf_layouts_and_deferred_init, 2, timeout_s=200)[0]
    assert set(diffs) == {"ddp", "fsdp", "tp", "pp"} and max(diffs.values()) < 2e-5, diffs
    assert init == 0.0 and same_buffers  # rotary inv_freq computed on the device, as the model computes it


@hf
def test_a_checkpointed_hugging_face_llama_keeps_no_cache_and_computes_the_same_gradients():
    """transformers' models keep a key-value cache unless told not to, and a recomputed forward added its keys and
    values to it a second time (its attention then sliced the doubled cache back; by operation, torch's selective
    checkpointing saw the recomputation take that other path and stopped: "aten.slice.Tensor invocation index 4
    encountered during backward but not found in storage"). The toolkit turns the cache off when it checkpoints, as
    transformers does under its own gradient checkpointing: every block, every second one and by operation, the
    gradients are the uncheckpointed model's to the bit, and the output carries no cache."""
    x = torch.randint(0, fm.VOCAB, (2, fm.SEQ), generator=torch.Generator().manual_seed(0))
    grads = {}
    for flag in (False, True, 2, "op"):
        llama = fm.hf_model("llama")
        model, _ = toolkit.parallel.wrap(llama, "local", activation_checkpointing=flag)
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        grads[flag] = [p.grad for p in model.parameters()]
        assert (out.past_key_values is None) == bool(flag) and llama.config.use_cache == (not flag), flag
    for flag in (True, 2, "op"):
        assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[flag])), flag


@hf
def test_hugging_face_models_simulate_at_512_ranks_with_buffers_and_routing(capsys):
    from toolkit.sim import simulate

    for name, strategy, options in (
        ("llama", "fsdp", {}),
        ("mixtral", "ddp", {}),
        ("bert", "zero3", dict(pp=2)),
        ("vit", "ddp", dict(tp=2, tp_plan={"vit.layers.*.mlp.fc1": "colwise", "vit.layers.*.mlp.fc2": "rowwise"})),
    ):
        sim = simulate(
            functools.partial(fm.hf_model, name), strategy, 512, batch_per_rank=2, progress=False, steps=1, **options
        )
        assert sim.num_params == sum(p.numel() for p in fm.hf_model(name).parameters()), name
    assert sim.seq_len == (16 // 4) ** 2 + 1  # a ViT's tokens: its patches and the class token
    split = (
        "pipeline split of BertForMaskedLM (bert-like, 2 layers over 2 stages): stage 0: embedding + "
        "bert.encoder.layer.0 | stage 1: bert.encoder.layer.1 + final norm, head and loss"
    )
    assert split in capsys.readouterr().out
    with pytest.raises(ValueError, match="a loss_fn cannot be used"):
        from toolkit.train import TrainConfig, train

        train(TrainConfig(options={"pp": 2}), loss_fn=lambda m, x, y: m(x, y))


@hf
def test_tensor_parallel_plans_for_hugging_face_models_say_what_to_do():
    from toolkit.sim import simulate

    def sim(name, plan):
        simulate(lambda: fm.hf_model(name), "local", 2, tp=2, tp_plan=plan, progress=False, steps=1, warmup=False)

    with pytest.raises(
        ValueError,
        match=r"'transformer.h.0.attn.c_attn', a fused q/k/v projection .*separate q, k and "
        r"v projections.*split the MLP only",
    ):
        sim("gpt2", {"transformer.h.*.attn.c_attn": "colwise"})
    with pytest.raises(
        ValueError,
        match=r"It holds no Linear layer to split. Its \['gate_up_proj', 'down_proj'\] are "
        r"the experts.*expert_parallel.*named like \['model.embed_tokens'",
    ):
        sim("mixtral", {"model.layers.*.mlp.experts": "colwise"})


@hf
def test_a_hugging_face_moe_made_expert_parallel_computes_what_the_model_does_and_draws_its_load():
    from toolkit import viz
    from toolkit.moe.hf import expert_parallel
    from toolkit.train import TrainConfig, train
    from toolkit.viz.expert_load import load_rows

    for name in ("mixtral", "qwen2_moe"):
        plain, ep = fm.hf_model(name), expert_parallel(fm.hf_model(name))
        x = torch.randint(0, fm.VOCAB, (2, fm.SEQ))
        losses = [m(input_ids=x, labels=x, shift_labels=x).loss for m in (plain, ep)]
        for loss in losses:
            loss.backward()
        assert torch.allclose(*losses, atol=1e-6)
        assert [n for n, _ in ep.named_parameters()] == [n for n, _ in plain.named_parameters()]  # names kept
        assert max((p.grad - q.grad).abs().max().item() for p, q in zip(plain.parameters(), ep.parameters())) < 1e-6
    run = train(TrainConfig(steps=2, progress=False), model_fn=lambda config: expert_parallel(fm.hf_model("mixtral")))
    figure = viz.expert_load(run, "model.layers.0.mlp.experts")
    counts = [row["counts"] for row in load_rows(run, "model.layers.0.mlp.experts")]
    assert len(counts) == 2 and all(sum(c) == 8 * fm.SEQ * 2 for c in counts)  # every (token, choice), top-2
    assert figure.data[0].z is not None


@hf
def test_the_command_line_simulates_a_hugging_face_config(tmp_path, capsys):
    from toolkit.sim.cli import main

    fm.hf_config("llama", architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path / "llama")
    assert (
        main(
            [
                "--model",
                str(tmp_path / "llama"),
                "--strategy",
                "zero3",
                "--world-size",
                "64",
                "--cluster",
                "none",
                "--seq-len",
                "32",
                "--out",
                str(tmp_path / "runs"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    params = sum(p.numel() for p in fm.hf_model("llama").parameters())  # 22,688: "22.7K"
    assert f"{params / 1e3:.1f}K parameters, batch 1 x 32" in out, out
    assert list((tmp_path / "runs").glob("sim-llama-zero3-64*-run.json"))  # named by the config's folder
    with pytest.raises(SystemExit, match="2"):
        main(["--model", "no-such-model", "--cluster", "none", "--out", str(tmp_path)])
    assert "neither a preset" in capsys.readouterr().err


@hf
def test_a_pipelines_three_parts_compute_what_the_hugging_face_model_computes():
    """embed, each layer called as layer(h) (its mask, positions and rotary added from h), head_loss: the model's
    own logits and loss, for every family. Weights drawn wide (std 0.5) so positions and masks matter."""
    from toolkit.models.hf_pipeline import pipelined
    from toolkit.models.protocol import recognise

    for name in fm.HF_MODELS:
        model = fm.hf_model(name, initializer_range=0.5)
        convention = recognise(model)
        x, y = convention.data(model, vocab_size=fm.VOCAB, seq_len=fm.SEQ).batch(0, 2)
        want = convention.loss(model, x, y)
        logits = model(**({"pixel_values": x} if name == "vit" else {"input_ids": x})).logits
        pipelined(model)
        h = model.embed(x)
        assert h.shape == model.hidden_shape(x.shape)
        for layer in model.get_submodule(model._pipeline_family.layers(model)):
            out = layer(h)
            h = out[0] if isinstance(out, tuple) else out
        assert torch.allclose(model.head_loss(h, None), logits, atol=1e-5), name
        assert torch.allclose(model.head_loss(h, y), want, atol=1e-6), name
