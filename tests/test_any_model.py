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

import pytest
import torch
import torch.nn as nn

import foreign_models as fm
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
    refused = None
    if which == "encoder":  # a parent reading its child's weight: zero3 must say so, not crash obscurely
        try:
            model, _ = wrap(fm.ReadsChildWeight(), "zero3", optimizer=OPTIMIZER)
            model(torch.randn(2, 4))
        except RuntimeError as exc:
            refused = str(exc)
    policy = [m["value"] for m in recorder.metrics if m["name"] == "fsdp/wrap_policy"]
    return diffs, policy, refused


@pytest.mark.timeout(180)
def test_torch_transformer_encoder_lm_trains_the_same_under_every_strategy(no_leftover_ranks):
    diffs, policy, refused = toolkit.launch(every_strategy, 2, args=("encoder",))[0]
    assert set(diffs) == set(STRATEGIES)
    assert max(diffs.values()) < 1e-5, diffs  # fp32: only the order of the sums differs
    assert policy == ["wrap_policy=None (the default): the model's repeated layers, one unit each: "
                      "encoder.layers (2 x TransformerEncoderLayer), plus the root for the rest"]
    assert refused is not None and "read a parameter at another time" in refused and "Use fsdp" in refused


@pytest.mark.timeout(180)
def test_hugging_face_gpt2_trains_the_same_under_every_strategy(no_leftover_ranks):
    pytest.importorskip("transformers", reason="Hugging Face transformers is not installed: pip install -e '.[hf]' "
                                               "(make setup installs it) to run the GPT-2 any-model test")
    diffs, policy, _ = toolkit.launch(every_strategy, 2, args=("gpt2",))[0]
    assert max(diffs.values()) < 1e-5, diffs
    assert policy == ["wrap_policy=None (the default): the model's repeated layers, one unit each: "
                      "transformer.h (2 x GPT2Block), plus the root for the rest"]


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
