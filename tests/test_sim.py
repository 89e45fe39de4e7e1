"""The simulated cluster: what a Simulation holds, and how it fails.

(Exact numbers: tests/test_sim_vs_real.py against real gloo runs, tests/test_sim_scale.py against the
papers; the fake process group itself: tests/test_sim_fake.py.)
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from toolkit.models import tiny_gpt
from toolkit.sim import Collective, Compute, Wait, simulate
from toolkit.sim.program import check
from toolkit.trace.analysis import bytes_per_step

SMALL = dict(n_layer=2, d_model=64, n_head=4)


def small():
    return tiny_gpt(**SMALL)


def test_a_step_is_a_program_of_compute_collectives_and_waits():
    sim = simulate(small, "zero3", 4, steps=2, progress=False)
    assert len(sim.programs) == 2
    for program in sim.programs:
        check(program)
        kinds = {type(i) for i in program}
        assert kinds == {Compute, Collective, Wait}
        issued = [i for i in program if isinstance(i, Collective)]
        waited = {i.id for i in program if isinstance(i, Wait)}
        assert waited == {c.id for c in issued}  # every collective is waited on within its step
        for c in issued:
            assert c.group == (0, 1, 2, 3) and c.op in ("all_gather", "reduce_scatter")
        assert {c.phase for c in issued} == {"forward", "backward"}
    # FLOPs: the same ops FlopCounterMode counts; about 6 x params x tokens plus attention
    tokens = sim.batch_per_rank * sim.seq_len
    assert 6 * sim.num_params * tokens < sim.flops < 1.2 * 6 * sim.num_params * tokens
    assert sim.flops == sum(i.flops for i in sim.programs[-1] if isinstance(i, Compute))
    assert sim.programs[0] == sim.programs[1]  # a steady state: both steps issue the same program
    # the Run the simulation leaves reads as a real one: trace analysis finds the same bytes per step
    assert bytes_per_step(sim.run, 0)[-1] == sim.bytes_per_phase
    sent = 3 * sim.message_bytes["reduce_scatter"] * 3 // 4  # three passes of the model, ring factor 3/4
    assert sim.bytes_per_phase["total"] == sim.bytes_per_step["total"] == sent


def test_leaves_the_process_clean_even_after_an_error():
    with pytest.raises(ValueError, match="unknown option"):
        simulate(small, "zero2", 16, progress=False, bucket_size=3)
    assert not dist.is_initialized()
    sim = simulate(small, "ddp", 2, progress=False)  # a second simulation in the same process works
    assert sim.bytes_per_step["all_reduce"] > 0
    assert not dist.is_initialized()


def test_each_simulation_gives_back_the_excepthook_and_toolkit_sim_is_an_attribute():
    """torch's process group wraps sys.excepthook to prefix tracebacks with "[rank0]:", once more per group: after
    N simulations every traceback would carry N prefixes. And `import toolkit; toolkit.sim` works, as viz does."""
    import subprocess
    import sys

    import toolkit

    assert toolkit.sim.simulate is simulate
    hook = sys.excepthook
    for _ in range(2):
        simulate(small, "ddp", 2, progress=False)
        assert sys.excepthook is hook
    script = (
        "import toolkit\ntoolkit.sim.simulate(toolkit.models.tiny_gpt, 'ddp', 2, progress=False)\n"
        "raise SystemError('after a simulation')"
    )
    err = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300).stderr
    assert "SystemError: after a simulation" in err and "[rank0]" not in err, err[-2000:]


@pytest.mark.parametrize(
    "call, message",
    [
        (dict(strategy="zero4", world_size=8), "unknown strategy"),
        (dict(strategy="ddp", world_size=65537), "1 to 65536"),
        (dict(strategy="ddp", world_size=12, ranks_per_node=8), "whole number of nodes"),
        (dict(strategy="ddp", world_size=8, rank=8), "not a rank"),
    ],
)
def test_bad_input_is_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        simulate(small, progress=False, **call)
    assert not dist.is_initialized()


def test_a_model_instead_of_the_function_that_builds_it_is_named():
    with pytest.raises(ValueError, match=r"not a model already built \(got a GPT\).*lambda: tiny_gpt"):
        simulate(small(), "ddp", 2, progress=False)
    assert not dist.is_initialized()


def test_mfu_without_a_cluster_is_an_error_and_a_bad_one_says_its_range():
    with pytest.raises(ValueError, match="mfu=0.5 is the fraction .* no cluster was given: pass cluster="):
        simulate(small, "ddp", 2, mfu=0.5, progress=False)
    for where in ({}, {"cluster": "dgx-a100"}):
        with pytest.raises(ValueError, match=r"mfu=7: the achievable fraction of peak must be in \(0, 1\]"):
            simulate(small, "ddp", 2, mfu=7, progress=False, **where)
    assert not dist.is_initialized()


def test_ranks_per_node_that_changes_a_presets_nodes_is_said():
    """A DGX node has 8 GPUs: asking for 2 per node is a what-if the warning names; the cluster's own nodes
    (the default) and a cluster of 2-GPU nodes are priced without a word."""
    from toolkit.sim import cluster_of

    with pytest.warns(
        UserWarning,
        match=r"ranks_per_node=2: 'dgx-a100' has nodes of 8 GPUs; priced as 'dgx-a100' "
        r"with nodes of 2.*cluster_of\(cluster, gpus_per_node=2\)",
    ):
        asked = simulate(small, "ddp", 4, ranks_per_node=2, cluster="dgx-a100", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        default = simulate(small, "ddp", 4, cluster="dgx-a100", progress=False)
        said = simulate(small, "ddp", 4, cluster=cluster_of("dgx-a100", gpus_per_node=2), progress=False)
    assert default.ranks_per_node == 4 and asked.ranks_per_node == said.ranks_per_node == 2  # nodes of the world
    assert asked.step_time == said.step_time != default.step_time  # two nodes: the all-reduce crosses the network


def test_a_model_that_cannot_be_built_on_meta_is_named():
    class ReadsValues(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4))
            self.scale = float(self.w.sum())  # reading a value: impossible on meta

    with pytest.raises(ValueError, match="ReadsValues"):
        simulate(ReadsValues, "ddp", 2, progress=False)
    assert not dist.is_initialized()


@pytest.mark.parametrize("strategy, options", [("zero2", {"bucket_cap_mb": 0.05}), ("zero3", {})])
def test_sharded_gradients_do_not_pile_up_in_flight(strategy, options):
    """ZeRO-2/3 free a reduction's full-size input before the next one starts (as FSDP does): at the peak
    late in backward, the gradients handed to reduce-scatters are one bucket's, not the whole model's."""
    sim = simulate(
        lambda: tiny_gpt(n_layer=8, d_model=128, n_head=4),
        strategy,
        8,
        batch_per_rank=1,
        seq_len=4,
        progress=False,
        **options,
    )
    assert sim.peak_moment["pass"] == "backward"
    full_gradients = sim.num_params * 4
    assert sim.peak_memory["comm"] <= 0.1 * full_gradients, sim.peak_memory


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_gradients_reduced_in_fp32_cost_their_bytes_in_memory_and_on_the_wire(strategy):
    """Main gradients (reduce_dtype fp32): 4 bytes of gradient a parameter where bf16 keeps 2, and the reduce-scatter's
    bytes doubled while the all-gather's stay; the formulas (`Simulation.theory`) say the same, up to the padding."""
    sims = [
        simulate(small, strategy, 8, batch_per_rank=1, progress=False, mixed_precision=dict(param_dtype="bf16", **r))
        for r in ({}, {"reduce_dtype": "fp32"})
    ]
    bf16, fp32 = sims
    assert fp32.memory["grads"] == 2 * bf16.memory["grads"] and fp32.memory["params"] == bf16.memory["params"]
    assert fp32.bytes_per_step["reduce_scatter"] == 2 * bf16.bytes_per_step["reduce_scatter"]
    assert fp32.bytes_per_step["all_gather"] == bf16.bytes_per_step["all_gather"]
    for sim in sims:
        theory = sim.theory()
        assert sim.memory["grads"] == pytest.approx(theory["model_states"]["grads"], rel=0.01)
        assert sim.bytes_per_step["total"] == pytest.approx(theory["bytes_per_step"], rel=0.01)


def test_attention_keeps_what_the_fused_kernel_keeps():
    """On meta, torch's attention would take the math path and keep (heads, s, s) scores; a real rank's fused
    kernel keeps O(s). Doubling the sequence must about double the activations, not quadruple them, and the
    FLOPs still count attention (the fused kernel's formula)."""

    def after_forward(seq):
        sim = simulate(
            lambda: tiny_gpt(n_layer=2, d_model=64, n_head=4, seq_len=seq), "ddp", 2, seq_len=seq, progress=False
        )
        return next(s["activations"] for s in sim.samples if s["phase"] == "forward"), sim

    short, _ = after_forward(256)
    long, sim = after_forward(512)
    assert long / short < 2.2, (short, long)
    matmul_flops = 6 * sim.num_params * 512  # the dense part; attention adds its s^2 terms on top
    assert sim.flops > matmul_flops


def test_hybrid_sharding_reduces_in_its_reduce_dtype_as_the_formula_says():
    """FSDP with its shards over groups of 4 and their replicas all-reduced (HSDP), gradients reduced in fp32: the
    reduce-scatter and the replicas' all-reduce move 4 bytes a value, the all-gathers 2; the formula says the same."""
    sim = simulate(
        small,
        "fsdp",
        8,
        batch_per_rank=1,
        progress=False,
        sharding_group_size=4,
        mixed_precision=dict(param_dtype="bf16", reduce_dtype="fp32"),
    )
    assert sim.bytes_per_step["total"] == pytest.approx(sim.theory()["bytes_per_step"], rel=0.01)
