"""Tensor parallelism measured: the simulated rank against a real gloo run, both against the formulas.

- The simulator runs the same tensor-parallel code on the fake group: the bytes per step and the model states
  equal a real run's exactly at world 2 (tp 2) and 4 (dp 2 x tp 2), and the peak is within 10% of the CPU
  allocator's (as tests/test_sim_vs_real.py holds the data-parallel strategies).
- Bytes equal `tp_bytes_per_step` (4 all-reduces of b·s·h per block, or sequence parallelism's halves and its
  extra all-gathers) plus the data-parallel strategy's over dp; model states equal `tp_model_states`.
- Activations kept per block on a real rank equal Korthikanti's per-layer terms split by t
  (`tp_activation_terms`), with and without sequence parallelism.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_sim_vs_real import allocator_peak, structure

import toolkit
from toolkit.memory import (
    activations_by_module,
    gpt_parameter_split,
    tp_activation_bytes,
    tp_activation_terms,
    tp_bytes_per_layer,
    tp_bytes_per_step,
    tp_model_states,
)
from toolkit.models import SyntheticCorpus, tiny_gpt
from toolkit.sim import simulate
from toolkit.train import TrainConfig, train

SMALL = dict(n_layer=2, d_model=64, n_head=4)
BATCH = 2  # sequences per data-parallel replica
CASES = {
    2: [
        ("local", {"tp": 2}),
        ("local", {"tp": 2, "sequence_parallel": True}),
        ("local", {"tp": 2, "sequence_parallel": True, "tp_comm_overlap": True}),
    ],
    4: [("fsdp", {"tp": 2}), ("zero1", {"tp": 2, "sequence_parallel": True, "mixed_precision": True})],
}


def test_the_terms_add_up_to_korthikantis_closed_forms():
    for s, b, h, a, t in ((2048, 1, 12288, 96, 8), (512, 4, 1024, 16, 2), (32, 2, 64, 4, 4)):
        for sp in (False, True):
            assert sum(tp_activation_terms(s, b, h, a, t, sequence_parallel=sp).values()) == pytest.approx(
                tp_activation_bytes(s, b, h, a, t, sequence_parallel=sp), rel=1e-12
            )
        assert tp_activation_bytes(s, b, h, a, 1) == s * b * h * (34 + 5 * a * s / h)  # t = 1: no split
    # the paper's per-layer bytes for GPT-3 175B (s 2048, h 12288, a 96) at t = 8, b = 1: TP 10 + 24/8 + 5as/(8h)
    assert tp_activation_bytes(2048, 1, 12288, 96, 8) / (2048 * 12288) == 10 + 3 + 5 * 96 * 2048 / (12288 * 8)
    # sequence parallelism's bytes per layer equal tensor parallelism's less its extra all-gathers: 10 vs 8 halves
    assert tp_bytes_per_layer(1, 2048, 12288, 8, sequence_parallel=True) == pytest.approx(
        10 / 8 * tp_bytes_per_layer(1, 2048, 12288, 8)
    )


def measured_activations(options) -> list[int]:
    """Bytes autograd keeps per block on this rank for one forward of the tensor-parallel GPT."""
    torch.manual_seed(0)
    model, _ = toolkit.parallel.wrap(tiny_gpt(**SMALL), "local", **options)
    x, y = SyntheticCorpus().batch(0, BATCH)
    return activations_by_module(model, model.module.blocks, x, y)[0]


def real_runs(cases):
    rank, world = dist.get_rank(), dist.get_world_size()
    found = []
    for strategy, options in cases:
        dp = world // options["tp"]
        config = TrainConfig(
            strategy=strategy, steps=2, global_batch_size=BATCH * dp, model=SMALL, options=dict(options), progress=False
        )
        run = train(config)
        after_backward = next(s for s in run.samples if s["step"] == 1 and s["phase"] == "backward")
        found.append(
            {
                "bytes": toolkit.trace.analysis.bytes_per_step(run, rank)[-1],
                "states": {k: after_backward[k] for k in ("params", "grads", "optimizer")},
                "peak": allocator_peak(strategy, options, world, rank),
                **structure(run, rank),
                "activations": measured_activations(options) if strategy == "local" else None,
            }
        )
    return found


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [2, 4])
def test_simulated_tensor_parallel_rank_equals_a_real_gloo_run_and_the_formulas(world, no_leftover_ranks):
    rank = world - 1
    sims = [
        simulate(
            lambda: tiny_gpt(**SMALL),
            strategy,
            world,
            rank=rank,
            batch_per_rank=BATCH,
            ranks_per_node=2,
            progress=False,
            cluster="dgx-a100",
            **options,
        )
        for strategy, options in CASES[world]
    ]
    real = toolkit.launch(real_runs, world, args=(CASES[world],), timeout_s=300, quiet=True)
    L, h, a, s, V = SMALL["n_layer"], SMALL["d_model"], SMALL["n_head"], 32, 64
    counts = gpt_parameter_split(V, s, L, h)
    for (strategy, options), sim, measured in zip(CASES[world], sims, real[rank]):
        case = f"{strategy} {options} rank {rank}/{world}"
        sp, t, value = options.get("sequence_parallel", False), options["tp"], 2 if "mixed_precision" in options else 4
        assert sim.bytes_per_phase == measured["bytes"], case
        assert {k: sim.memory[k] for k in measured["states"]} == measured["states"], case
        assert abs(sim.peak - measured["peak"]) <= 0.10 * measured["peak"], (case, sim.peak, measured["peak"])
        assert structure(sim.modelled_run, rank, last_step=len(sim.programs) - 1) == {
            k: measured[k] for k in ("collectives", "unit spans")
        }, case
        # the formulas: the split/replicated count, the bytes to the byte, the model states
        assert (
            sim.tensor_parallel["split"] == counts["split"]
            and sim.tensor_parallel["replicated"] == counts["replicated"]
        )
        theory = sim.theory()
        assert sim.bytes_per_step["total"] == theory["bytes_per_step"], case
        tp_group = tuple(range(rank - rank % t, rank - rank % t + t))  # consecutive ranks
        tp_ops = {
            op: sum(c.bytes_sent for c in sim.collectives() if op == c.op and c.group == tp_group)
            for op in ("all_reduce", "all_gather", "reduce_scatter", "send")
        }
        formula = tp_bytes_per_step(BATCH, s, h, L, t, sequence_parallel=sp, bytes_per_value=value)
        if options.get("tp_comm_overlap"):  # the layers' all-gathers and reduce-scatters as passes around a ring
            assert tp_ops["send"] > 0 and sum(tp_ops.values()) == formula["total"], case
        else:
            assert {op: b for op, b in tp_ops.items() if b} == {
                op: b for op, b in formula.items() if op != "total" and b
            }
        stage = {"local": 0, "zero1": 1, "fsdp": 3}[strategy]
        kept = (4, 4, 8) if strategy == "fsdp" else (value, value, 12 if value == 2 else 8)
        states = tp_model_states(
            counts["split"],
            counts["replicated"],
            t,
            world // t,
            stage,
            param_bytes=kept[0],
            grad_bytes=kept[1],
            optimizer_multiplier=kept[2],
        )
        for k in ("params", "grads"):
            assert abs(sim.memory[k] - states[k]) < world, (case, k)  # a flat buffer pads to a multiple of dp
        if measured["activations"] is not None:  # Korthikanti's terms on one tp rank, this GPT's switches
            terms = tp_activation_terms(
                s,
                BATCH,
                h,
                a,
                t,
                sequence_parallel=sp,
                bytes_per_value=4,
                dropout=False,
                fused_attention=True,
                small_terms=True,
            )
            assert measured["activations"] == [sum(terms.values())] * L, (case, terms)


@pytest.mark.parametrize("sp, overlap", [(False, False), (True, False), (True, True)])
def test_activation_checkpointing_repeats_the_collectives_of_the_forward_it_runs_again(sp, overlap):
    """Backward re-runs each checkpointed block's forward (every block, or every second) as far as torch's
    checkpoint needs: one more all-reduce per block
    (the attention's g), or under sequence parallelism two all-gathers and a reduce-scatter, and with
    tp_comm_overlap the MLP's reduce-scatter too (its ring is one Function with the GEMM whose input backward needs).
    The simulated rank (the same code as a real one) sends what `tp_bytes_per_step(recompute=True)` says, its
    summary no more than its theory."""
    for layers in (2, 3):
        sims = {
            c: simulate(
                lambda layers=layers: tiny_gpt(**dict(SMALL, n_layer=layers)),
                "local",
                2,
                batch_per_rank=BATCH,
                tp=2,
                sequence_parallel=sp,
                tp_comm_overlap=overlap,
                activation_checkpointing=c,
                progress=False,
            )
            for c in (False, True, 2)  # 2: every second block
        }
        for recompute, sim in sims.items():
            formula = tp_bytes_per_step(
                BATCH, 32, SMALL["d_model"], layers, 2, sequence_parallel=sp, recompute=recompute, comm_overlap=overlap
            )
            if overlap:  # the layers' collectives are sends now: the same bytes in all
                assert sim.bytes_per_step["send"] > 0 and sim.bytes_per_step["total"] == formula["total"]
            else:
                assert {op: b for op, b in sim.bytes_per_step.items()} == {op: b for op, b in formula.items() if b}
            assert sim.theory()["bytes_per_step"] == sim.bytes_per_step["total"]
        halves = 4 if overlap else 3 if sp else 2
        for k, recomputed in ((True, layers), (2, layers // 2)):
            extra = sims[k].bytes_per_step["total"] - sims[False].bytes_per_step["total"]
            assert extra == recomputed * halves * (2 - 1) / 2 * BATCH * 32 * SMALL["d_model"] * 4


def test_tp_comm_overlap_hides_the_layers_traffic_behind_their_gemms_on_a_gpu():
    """dgx-h100, tp 4 + sp inside a node, a GPT 4,096 wide (2 blocks, 4 sequences of 2,048): sequence parallelism's
    all-gathers and reduce-scatters stall the compute stream for their whole time (nothing else can run: the GEMM
    needs them); with `tp_comm_overlap` each ring pass is beside one chunk's GEMM, and each of the column layer's
    backward collectives beside a whole GEMM, which take longer: under a sixth of the stall is left, most of it the
    embedding's reduce-scatter and its backward, which nothing hides. The same bytes either way, and a pass's
    receive takes no link time of its own (full duplex: one transfer's time a pass, not two)."""
    sims = {
        overlap: simulate(
            lambda: tiny_gpt(n_layer=2, d_model=4096, n_head=32, vocab_size=32768, seq_len=2048),
            "local",
            4,
            batch_per_rank=4,
            cluster="dgx-h100",
            progress=False,
            mixed_precision=True,
            tp=4,
            sequence_parallel=True,
            tp_comm_overlap=overlap,
        )
        for overlap in (False, True)
    }

    def stalled_on_layers(sim) -> float:
        spans = sim.cost.timelines[-1].spans
        comm = {s.instruction.id: s.instruction for s in spans if s.kind == "comm"}
        label = lambda c: str(c.args.get("tp", ""))  # noqa: E731
        layers = {i for i, c in comm.items() if label(c).startswith(("sequence", "column", "row"))}
        return sum(s.end - s.start for s in spans if s.kind == "wait" and s.instruction.id in layers)

    blocking, ringed = (stalled_on_layers(sims[o]) for o in (False, True))
    assert blocking > 0.1 * sims[False].step_time
    assert ringed < blocking / 6
    assert sims[True].bytes_per_step["total"] == sims[False].bytes_per_step["total"]
    passes = [s for s in sims[True].cost.timelines[-1].spans if s.kind == "comm" and s.instruction.op == "recv"]
    assert passes and all(s.start == s.issued and s.cost.resources == () for s in passes)


def test_tp_rings_inside_pipeline_stages_are_no_pipeline_transfers():
    """pp 2 x tp 2 + sp: the tensor-parallel rings' sends go to the tp neighbour inside the stage, priced on their
    link as one rank's collectives are, not matched with a receive of the next stage as a pipeline transfer would be
    (labelled `args["tp"]`, as a cp ring's `args["cp"]`): the same bytes as the blocking layers, every send counted."""
    sims = [
        simulate(
            lambda: tiny_gpt(n_layer=4, n_head=4),
            "local",
            4,
            pp=2,
            tp=2,
            sequence_parallel=True,
            tp_comm_overlap=overlap,
            microbatches=4,
            batch_per_rank=4,
            cluster="dgx-h100",
            progress=False,
        )
        for overlap in (False, True)
    ]
    assert sims[1].bytes_per_step["total"] == sims[0].bytes_per_step["total"]
    assert sims[1].bytes_per_step["send"] > sims[0].bytes_per_step["send"]
