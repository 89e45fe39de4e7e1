"""`tp_comm_overlap="backward"`: Megatron-LM's own overlap before TransformerEngine (its default, which
`--no-async-tensor-model-parallel-allreduce` turns off), the column layers' backward collectives beside the GEMM that
does not need them: without sequence parallelism f's all-reduce of the input's gradient beside the weight's, with it
the input's all-gather beside the input's gradient and that gradient's reduce-scatter beside the weight's
(`LinearWithGradAccumulationAndAsyncCommunication`). The forward blocks as before.

The same collectives, the same bytes, the same arithmetic in the same order: a real run equals the blocking one to the
bit. The simulated rank (the same code) hides the backward's collectives and prices the step faster.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import toolkit
from toolkit.models import SyntheticCorpus, tiny_gpt
from toolkit.trace.events import recorder

SHAPE = dict(n_layer=2, d_model=64, n_head=4)
LAYOUTS = {"tp": {}, "tp+sp": {"sequence_parallel": True}}


def one_step(overlap, **options) -> dict:
    """A training step on a tp rank: loss, the full state after the update, the collectives issued in backward."""
    torch.manual_seed(0)
    model, opt = toolkit.parallel.wrap(
        tiny_gpt(**SHAPE),
        "local",
        optimizer=torch.optim.SGD,
        tp=dist.get_world_size(),
        tp_comm_overlap=overlap,
        **options,
    )
    x, y = SyntheticCorpus().batch(0, 4)
    loss = model(x, y)
    recorder.reset()
    loss.backward()
    backward = [e for e in recorder.events if e["cat"] == "comm" and "tp" in e["args"]]
    opt.step()
    return {
        "loss": loss.item(),
        "state": toolkit.parallel.full_state_dict(model),
        "calls": sorted((e["name"], e["args"].get("size_bytes", 0)) for e in backward),
        "labels": {e["args"]["tp"] for e in backward},
    }


def both_ways():
    return {name: {o: one_step(o, **options) for o in (False, "backward")} for name, options in LAYOUTS.items()}


@functools.cache
def runs():
    return toolkit.launch(both_ways, 2, timeout_s=120, quiet=True)


@pytest.mark.timeout(200)
@pytest.mark.usefixtures("no_leftover_ranks")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_same_step_to_the_bit_with_the_same_collectives(layout):
    for rank in runs():
        blocking, overlapped = rank[layout][False], rank[layout]["backward"]
        assert overlapped["loss"] == blocking["loss"]
        assert all(torch.equal(overlapped["state"][k], v) for k, v in blocking["state"].items())
        assert overlapped["calls"] == blocking["calls"]  # the same collectives, the same sizes
        # issued by the fused column layers (the labels say which code sent them), where blocking f and the
        # sequence-parallel layer sent them
        column = {"tp": {"column backward all-reduce"}, "tp+sp": {"column backward reduce-scatter"}}[layout]
        assert column <= overlapped["labels"] and not column & blocking["labels"], overlapped["labels"]


def test_the_simulated_step_hides_the_backwards_collectives():
    """GPT-3's width at tp 8 on a DGX A100 node, with and without sequence parallelism: the same bytes, less exposed
    communication, a faster step."""
    from toolkit.models import presets
    from toolkit.sim import simulate

    for options in LAYOUTS.values():
        sims = {
            overlap: simulate(
                lambda: presets.gpt3_175b(n_layer=2),
                "local",
                8,
                batch_per_rank=4,
                tp=8,
                tp_comm_overlap=overlap,
                mixed_precision=True,
                progress=False,
                warmup=False,
                cluster="dgx-a100",
                **options,
            )
            for overlap in (False, "backward")
        }
        blocking, overlapped = sims[False], sims["backward"]
        assert overlapped.bytes_per_step == blocking.bytes_per_step
        assert overlapped.breakdown["overlapped_comm"] > 0.05 * overlapped.step_time
        assert blocking.breakdown["overlapped_comm"] < 1e-9 * blocking.step_time  # nothing hidden, to rounding
        assert overlapped.breakdown["exposed_comm"] < blocking.breakdown["exposed_comm"]
        assert overlapped.step_time < blocking.step_time
        assert "its backward's communication overlapped" in overlapped.summary()
