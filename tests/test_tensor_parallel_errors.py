"""Bad tensor-parallel input: each a clear error before training starts, saying what to do.

Checked on the simulated cluster (torch's fake process group, in this process): the same wrap code runs as on
real ranks, and nothing is launched.
"""

from __future__ import annotations

import warnings

import foreign_models as fm
import pytest

from toolkit.models import tiny_gpt
from toolkit.sim import simulate
from toolkit.train import TrainConfig


def sim(model_fn=tiny_gpt, strategy="local", world=2, **options):
    return simulate(model_fn, strategy, world, progress=False, steps=1, warmup=False, seq_len=32, **options)


@pytest.mark.parametrize(
    "model_fn, options, match",
    [
        (tiny_gpt, dict(tp=4, world=4), r"n_head=2 of 'blocks.0.attn' does not split over tp=4.*one of \[1, 2\]"),
        (
            lambda: tiny_gpt(d_ff=130, n_head=4),
            dict(tp=4, world=4),
            r"output features of 'blocks.0.mlp.fc' = 130 does not split over tp=4"
            r".*pad it to a multiple of 4 \(e.g. 132\)",
        ),
        (tiny_gpt, dict(tp=2, world=3), r"a world of 3 ranks does not split into pp=1 x tp=2"),
        (tiny_gpt, dict(sequence_parallel=True), r"sequence_parallel=True .* needs tp > 1"),
        (tiny_gpt, dict(tp=2, tp_comm_overlap=True), r"tp_comm_overlap=True .* needs sequence_parallel=True"),
        (
            tiny_gpt,
            dict(tp=2, sequence_parallel=True, tp_comm_overlap="yes"),
            r"tp_comm_overlap must be True \(TransformerEngine's rings\), \"backward\"",
        ),
        (fm.EncoderLM, dict(tp=2), r"default plan for the toolkit's GPT only; for a EncoderLM pass tp_plan="),
        (
            fm.EncoderLM,
            dict(tp=2, tp_plan={"encoder.layers.*.lin1": "colwise"}),
            r"tp_plan names 'encoder.layers.\*.lin1', which matches no module.*named like",
        ),
        (
            fm.EncoderLM,
            dict(tp=2, tp_plan={"encoder.layers.*.self_attn": "colwise"}),
            r"matches 'encoder.layers.0.self_attn', a MultiheadAttention; only nn.Linear, Hugging Face's Conv1D and "
            r"nn.Embedding can be split",
        ),
        (
            fm.EncoderLM,
            dict(tp=2, tp_plan={"embed": "vocab"}),
            r"'head.weight' is the same Parameter as one of 'embed'",
        ),
        (fm.EncoderLM, dict(tp=2, tp_plan={"embed": "sharded"}), r"styles are one of \('colwise', 'rowwise'"),
        (
            fm.EncoderLM,
            dict(tp=2, sequence_parallel=True, tp_plan={"head": "vocab", "embed": "vocab"}),
            r"sequence_parallel=True comes with the toolkit GPT's default plan",
        ),
    ],
)
def test_bad_input_is_refused_before_training(model_fn, options, match):
    options = dict(options)
    world = options.pop("world", 2)
    with pytest.raises(ValueError, match=match):
        sim(model_fn, "local" if world == options.get("tp", 1) else "ddp", world, **options)


def test_a_row_parallel_layer_fed_the_full_width_says_what_comes_before_it():
    with pytest.raises(
        ValueError,
        match=r"row-parallel layer 'encoder.layers.0.linear2' expects its slice of 64 "
        r"input features, got 128. It received the full width",
    ):
        sim(fm.EncoderLM, tp=2, tp_plan={"encoder.layers.*.linear2": "rowwise"})


def test_the_training_config_refuses_a_world_that_does_not_split_before_launching():
    with pytest.raises(ValueError, match=r"a world of 6 ranks does not split into pp=1 x tp=4"):
        TrainConfig(options={"tp": 4}).check_world(6)
    with pytest.raises(ValueError, match=r"global_batch_size=6 does not divide over dp=4 replicas \(world 8\)"):
        TrainConfig(global_batch_size=6, options={"tp": 2}).check_world(8)
    TrainConfig(global_batch_size=4, options={"tp": 2}).check_world(8)  # 4 replicas of 1 row: fine


def test_tensor_parallelism_across_nodes_is_simulated_with_its_cost_explained():
    with pytest.warns(UserWarning, match=r"tp=4 is wider than a node of 2 ranks.*cross the network"):
        wide = sim(lambda: tiny_gpt(n_head=4), "local", 4, tp=4, ranks_per_node=2, cluster="dgx-a100")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        narrow = sim(lambda: tiny_gpt(n_head=4), "local", 4, tp=4, cluster="dgx-a100")  # one node of 8
    assert wide.bytes_per_step == narrow.bytes_per_step  # the same collectives...
    assert wide.cross_node_bytes == wide.bytes_per_step["total"] and narrow.cross_node_bytes == 0
    assert wide.step_time > narrow.step_time  # ...on slower links, on the critical path
