"""Hugging Face models as they come, the whole matrix (make test-models; a thin slice is in test_any_model.py).

GPT-2, Llama, Mixtral, Qwen2-MoE (causal LMs), BERT (masked LM) and ViT (image classifier), built from tiny
configs with random weights, nothing downloaded, no adapter written:

- trained 2 SGD steps by every data-parallel strategy, tensor parallelism (their own plan, or one given where
  transformers declares none), pipeline parallelism (split automatically), expert parallelism (the MoE ones:
  plain, shadowed, with Tutel's pipelined all-to-all), hsdp, dp x pp, tp x pp, fsdp x tp and 3D, each held to
  plain torch (the model's own forward and loss, one process) on its full parameters and each step's loss;
- simulated at 512 ranks under each of those layouts: the model states equal the ZeRO formulas (exactly for
  ddp, within the flat tensors' padding sharded), the parameter count is the model's own.
"""

import functools

import foreign_models as fm
import hf_matrix
import pytest
import torch

import toolkit

pytest.importorskip("transformers", reason="Hugging Face transformers is not installed: pip install -e '.[dev]'")
pytestmark = pytest.mark.models


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("name", fm.HF_MODELS)
@pytest.mark.timeout(600)
def test_every_layout_trains_as_plain_torch_does(name, world, no_leftover_ranks):
    diffs = toolkit.launch(hf_matrix.train_layouts, world, args=(name, world), timeout_s=540)[0]
    expected = {label for label, *_ in hf_matrix.layouts(name, world)}
    errors = {k: v for k, v in diffs.items() if not k.endswith(("convention", "moe"))}
    assert set(errors) == expected, errors
    assert all(isinstance(v, float) and v < hf_matrix.TOLERANCE for v in errors.values()), errors
    kind = {"bert": "masked-lm", "vit": "image-classification"}.get(name, "causal-lm")
    assert {diffs[f"{label} convention"] for label in expected} == {kind}
    records = {label: diffs[f"{label} moe"] for label in expected if label.startswith("ep")}
    if records:  # the expert-parallel layer ran, shadowed and pipelined: each says so in the Run
        assert records == {
            "ep (ddp)": ["load"],
            "ep + shadowing": ["load", "shadow"],
            "ep + pipelined all-to-all": ["load", "pipeline"],
        }


@pytest.mark.parametrize("name", fm.HF_MODELS)
def test_the_reference_moves_far_beyond_the_tolerance(name):
    """Parity means something only if training changes the weights by much more than the tolerance."""
    start = {n: p.detach() for n, p in fm.hf_model(name).named_parameters()}
    moved = max((p - start[n]).abs().max().item() for n, p in hf_matrix.reference(name).items())
    assert moved > 100 * hf_matrix.TOLERANCE


@pytest.mark.parametrize("name", fm.HF_MODELS)
@pytest.mark.timeout(300)
def test_every_layout_simulates_at_512_ranks(name):
    sims = hf_matrix.simulate_layouts(name)
    with torch.device("meta"):
        model = hf_matrix.sim_model(name)
    whole, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    for label, sim in sims.items():
        assert sim.num_params == whole, (label, sim.num_params, whole)
        assert sim.peak > 0 and sum(sim.bytes_per_step.values()) > 0, label
    ddp, theory = sims["ddp"], dict(sims["ddp"].theory()["model_states"])
    theory["optimizer"] += 4 * tensors  # Adam's step counter, a float per tensor
    assert {k: ddp.memory[k] for k in theory} == theory
    for label in ("zero1", "zero2", "zero3", "fsdp", "hsdp"):  # the ZeRO stages' formulas, up to the padding
        sim = sims[label]
        for key, value in sim.theory()["model_states"].items():
            assert sim.memory[key] == pytest.approx(value, rel=0.01), (label, key, sim.memory[key], value)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_expert_parallel_hugging_face_moe_simulates_with_its_experts_split(name):
    """8 experts over 8 simulated ranks: every rank keeps one, the states are the formula's (dense parts replicated,
    one expert's whole), the tokens travel by all-to-all; shadowing adds the broadcast of its expert's weights."""
    from toolkit.moe.hf import expert_parallel
    from toolkit.sim import simulate

    experts = {"mixtral": "num_local_experts", "qwen2_moe": "num_experts"}[name]
    whole = sum(p.numel() for p in fm.hf_model(name, **{experts: 8}).parameters())

    def build(shadow):
        return expert_parallel(fm.hf_model(name, **{experts: 8}), shadow=shadow)

    sims = {
        label: simulate(functools.partial(build, shadow), "ddp", 8, batch_per_rank=2, progress=False)
        for label, shadow in (("plain", "off"), ("shadowed", [0]))
    }
    for sim in sims.values():
        assert sim.num_params == whole and sim.expert_parallel == 8
        theory = dict(sim.theory()["model_states"])
        theory["optimizer"] += 4 * sum(1 for _ in fm.hf_model(name).parameters())  # Adam's step counters
        assert {k: sim.memory[k] for k in theory} == theory
        assert sim.bytes_per_step["all_to_all"] > 0
    layers = fm.hf_config(name).num_hidden_layers
    one_expert = 4 * sum(
        p[0].numel() for n, p in fm.hf_model(name).named_parameters() if n.startswith("model.layers.0.mlp.experts.")
    )  # fp32 bytes of expert 0 of one layer
    shadowed = sims["shadowed"].bytes_per_step["broadcast"] - sims["plain"].bytes_per_step["broadcast"]
    assert shadowed == layers * one_expert  # each layer's expert 0 broadcast once, from its owner (this rank)
    assert sims["shadowed"].bytes_per_step["all_to_all"] < sims["plain"].bytes_per_step["all_to_all"]  # rows stay home
