"""The simulated cluster: the strategies' own code for one rank of a large cluster, on meta tensors.

Expected values are the formulas of toolkit.memory.formulas evaluated on the model's own parameter
count, and the papers' published numbers (ZeRO Figure 1, GPT-3 175B, the FSDP paper's traffic).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from toolkit.memory import formulas, model_states
from toolkit.models import presets, tiny_gpt
from toolkit.sim import Collective, Compute, Wait, simulate
from toolkit.sim.program import check
from toolkit.trace.analysis import bytes_per_step

GB = 1e9
SMALL = dict(n_layer=2, d_model=64, n_head=4)


def small():
    return tiny_gpt(**SMALL)


@pytest.mark.parametrize("strategy, stage", [("ddp", 0), ("zero1", 1), ("zero2", 2), ("zero3", 3), ("fsdp", 3)])
def test_model_states_and_bytes_follow_the_formulas(strategy, stage):
    """Every strategy at 8 ranks: model states (2+2+12)Ψ by stage, exactly up to flat-buffer padding and
    Adam's 4-byte step counters; bytes sent = passes x 2Ψ x (N-1)/N up to padding."""
    sim = simulate(small, strategy, 8, progress=False, mixed_precision=True)
    psi, n = sim.num_params, 8
    expected = formulas.model_states_breakdown(psi, n, stage)
    if strategy == "fsdp":  # FSDP's shard is the fp32 master itself, its gradient shard fp32: 4 + 4 + 8
        expected = formulas.model_states_breakdown(psi, n, stage, param_bytes=4, grad_bytes=4, optimizer_multiplier=8)
    pad = 16 * n * 32  # at most N-1 padding elements per flat buffer (a few dozen buffers here), 16 bytes each
    for key in ("params", "grads", "optimizer"):
        assert expected[key] <= sim.memory[key] <= expected[key] + pad, key
    wire = formulas.communication_per_step(psi, n, strategy) * 2
    assert wire <= sim.bytes_per_step["total"] <= wire + 2 * 3 * pad
    assert sim.bytes_per_phase["total"] == sim.bytes_per_step["total"]  # the Run tells the same as the program
    assert bytes_per_step(sim.run, 0)[-1]["total"] == sim.bytes_per_step["total"]


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


def test_leaves_the_process_clean_even_after_an_error():
    with pytest.raises(ValueError, match="unknown option"):
        simulate(small, "zero2", 16, progress=False, bucket_size=3)
    assert not dist.is_initialized()
    sim = simulate(small, "ddp", 2, progress=False)  # a second simulation in the same process works
    assert sim.bytes_per_step["all_reduce"] > 0
    assert not dist.is_initialized()


@pytest.mark.parametrize("call, message", [
    (dict(strategy="zero4", world_size=8), "unknown strategy"),
    (dict(strategy="ddp", world_size=2048), "1 to 1024"),
    (dict(strategy="ddp", world_size=12, ranks_per_node=8), "whole number of nodes"),
    (dict(strategy="ddp", world_size=8, rank=8), "not a rank"),
])
def test_bad_input_is_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        simulate(small, progress=False, **call)
    assert not dist.is_initialized()


def test_a_model_that_cannot_be_built_on_meta_is_named():
    class ReadsValues(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4))
            self.scale = float(self.w.sum())  # reading a value: impossible on meta

    with pytest.raises(ValueError, match="ReadsValues"):
        simulate(ReadsValues, "ddp", 2, progress=False)
    assert not dist.is_initialized()
