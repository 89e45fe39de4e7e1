"""Bad input to pipeline parallelism: each a clear error, raised alike on every rank before training starts
(so nothing hangs), that says what was wrong and what would work."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

import toolkit
from toolkit.models import SyntheticCorpus, moe_gpt, tiny_gpt
from toolkit.parallel.pipeline.schedules import Action
from toolkit.train import TrainConfig


def wrong_order(pp, microbatches, rank, virtual_stages=1):
    """Stage 0 goes backward before sending micro-batch 1 on; stage 1 waits for it first (GPipe's order)."""
    if rank == 0:
        return [Action(k, i, 0) for i in range(microbatches) for k in "FB"]
    return [Action("F", i, 1) for i in range(microbatches)] + [Action("B", i, 1) for i in range(microbatches)]


CASES = {  # name -> (model, strategy, wrap options)
    "blocks do not split": (lambda: tiny_gpt(n_layer=3), "local", dict(pp=2)),
    "too few micro-batches": (lambda: tiny_gpt(), "local", dict(pp=2, microbatches=1)),
    "unknown schedule": (lambda: tiny_gpt(), "local", dict(pp=2, schedule="pipedream")),
    "pp_split names no module": (lambda: tiny_gpt(n_layer=4), "local", dict(pp=2, pp_split=["blocks.9"])),
    "pp_split names no block": (lambda: tiny_gpt(n_layer=4), "local", dict(pp=2, pp_split=["ln_f"])),
    "interleaved, one stage per rank": (lambda: tiny_gpt(n_layer=4), "local", dict(pp=2, schedule="interleaved")),
    "fp16": (lambda: tiny_gpt(), "local", dict(pp=2, mixed_precision=torch.float16)),
    "no stage protocol": (lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), "local", dict(pp=2)),
    "experts over the world": (lambda: moe_gpt(4, 2), "local", dict(pp=2)),
    "a schedule that deadlocks": (lambda: tiny_gpt(), "local", dict(pp=2, microbatches=2, schedule=wrong_order)),
    "zero-bubble under fsdp": (lambda: tiny_gpt(), "fsdp", dict(pp=2, schedule="zb-h1")),
}


def every_error():
    found = {}
    for name, (build, strategy, options) in CASES.items():
        torch.manual_seed(0)
        try:
            toolkit.parallel.wrap(build(), strategy, **options)
            found[name] = None
        except Exception as exc:  # noqa: BLE001 - the message is what is tested
            found[name] = f"{type(exc).__name__}: {exc}"
    model, _ = toolkit.parallel.wrap(tiny_gpt(), "local", pp=2, microbatches=4)
    x, y = SyntheticCorpus().batch(0, 6)
    for name, call in (
        ("model(x, y)", lambda: model(x, y)),
        ("batch does not split", lambda: model.forward_backward(x, y)),
    ):
        try:
            call()
            found[name] = None
        except Exception as exc:  # noqa: BLE001
            found[name] = f"{type(exc).__name__}: {exc}"
    return found


@functools.cache
def errors():
    return toolkit.launch(every_error, 2, timeout_s=180, quiet=True)


EXPECTED = {
    "blocks do not split": [
        "3 blocks (blocks.0..blocks.2) do not split evenly into pp=2 stages",
        "pp_split=['blocks.2']",
    ],
    "too few micro-batches": ["microbatches=1 < pp=2", "bubble", "microbatches >= 2"],
    "unknown schedule": ["unknown pipeline schedule 'pipedream'", "'1f1b'", "'gpipe'", "'interleaved'", "'zb-h1'"],
    "pp_split names no module": ["'blocks.9', which is no module", "blocks.0 .. blocks.3"],
    "pp_split names no block": ["'ln_f', which is not one of the repeated blocks"],
    "interleaved, one stage per rank": ["virtual_stages=2 or more"],
    "fp16": ["bfloat16"],
    "no stage protocol": ["embed(x)", "head_loss(h, y)", "has no ['embed', 'head_loss', 'hidden_shape']"],
    "experts over the world": ["ranks [0, 1]", "stage_group(pp=2"],
    "a schedule that deadlocks": [
        "PipelineDeadlock",
        "rank 0 waits at 0B0 (after 0F0)",
        "rank 1 waits at 1F1 (after 1F0) to receive the activation of micro-batch 1",
    ],
    "zero-bubble under fsdp": ["schedule='zb-h1' splits each backward in two", "schedule='1f1b' with fsdp"],
    "model(x, y)": ["model.forward_backward(x, y)", "pp = 2"],
    "batch does not split": ["a batch of 6 rows does not split into microbatches=4", "multiple of 4 (e.g. 8)"],
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(EXPECTED))
def test_bad_input_is_a_clear_error_on_every_rank(name, no_leftover_ranks):
    for message in (rank[name] for rank in errors()):  # every rank raises (none is left waiting for the other)
        assert message is not None, f"{name}: no error"
        for part in EXPECTED[name]:
            assert part in message, (name, part, message)


def test_train_config_says_microbatches_not_accumulation_under_pp():
    with pytest.raises(ValueError, match="leave accumulation at 1"):
        TrainConfig(options={"pp": 2}, accumulation=2).check_world(2)
    with pytest.raises(ValueError, match=r"global_batch_size=6 does not divide over .* microbatches=4"):
        TrainConfig(options={"pp": 2, "microbatches": 4}, global_batch_size=6).check_world(2)
