"""What the simulator adds for a tensor-parallel layout: the counts its theory needs, and where tp lands.

`simulate(..., tp=t)` runs the strategies' own tensor-parallel code on the fake group exactly as on real
ranks (the collectives go through the door with the tp group, so the programs and the cost model see which
ranks each joins). This file only

- describes the layout after wrapping: how many parameters are split and replicated (for
  `tensor_formulas.tp_model_states`) and, for the toolkit GPT, the tp collectives `tp_bytes_per_step` predicts;
- explains a tensor-parallel group wider than a node: allowed (a student should see the cliff), but every
  one of its collectives, two per block and pass, then crosses the network on the critical path.
"""

from __future__ import annotations

import warnings

from ..memory import formulas, tensor_formulas
from ..parallel import parameter_shapes
from ..parallel.checkpointing import blocks_recomputed


def describe(model, options: dict, batch: int, seq_len: int, world_size: int, ranks_per_node: int) -> dict | None:
    """{"tp", "dp", "split", "replicated", "sequence_parallel", "comm_overlap", "tp_bytes"} of a wrapped
    tensor-parallel model."""
    info = getattr(model, "tensor_parallel", None)
    if info is None:
        return None
    t = info.tp.size
    module = getattr(model, "module", model)
    shapes = parameter_shapes(model)  # not p.shape: a ZeRO-3 or FSDP parameter is this rank's piece between uses
    split = sum(shapes[n].numel() * t for n, s in info.splits.items() if s is not None and n in shapes)
    replicated = sum(shapes[n].numel() for n, s in info.splits.items() if s is None and n in shapes)
    tp_bytes = None
    from ..models.gpt import MLP
    from ..parallel.tensor.gpt import TensorParallelGPT

    if isinstance(module, TensorParallelGPT) and all(isinstance(b.mlp, MLP) for b in module.blocks):  # dense GPT
        value = 2 if options.get("mixed_precision") else 4
        tokens = seq_len // options.get("cp", 1)  # a cp rank's share of each sequence
        tp_bytes = tensor_formulas.tp_bytes_per_step(
            batch,
            tokens,
            module.config.d_model,
            module.config.n_layer,
            t,
            sequence_parallel=info.sequence_parallel,
            bytes_per_value=value,
            recompute=blocks_recomputed(options.get("activation_checkpointing", False)),
            comm_overlap=options.get("tp_comm_overlap") is True,  # "backward": the same messages as blocking
        )
    if t > ranks_per_node:
        warnings.warn(
            f"tp={t} is wider than a node of {ranks_per_node} ranks: the tensor-parallel group spans "
            f"{-(-t // ranks_per_node)} nodes, so its all-reduces (two per block forward, two backward, "
            f"nothing to hide them behind) cross the network at a node's card bandwidth instead of "
            f"NVLink's. Simulated as asked; Megatron keeps tp <= GPUs per node.",
            stacklevel=3,
        )
    pp, cp = options.get("pp", 1), options.get("cp", 1)
    return {
        "tp": t,
        "dp": world_size // (t * pp * cp),
        "split": split,
        "replicated": replicated,
        "sequence_parallel": info.sequence_parallel,
        "comm_overlap": options.get("tp_comm_overlap", False),
        "tp_bytes": tp_bytes,
    }


def theory(sim) -> dict:
    """`Simulation.theory()` for a tensor-parallel layout: model states of (Ψ_split/t + Ψ_rep) under the
    strategy over dp, bytes = the dp strategy's over dp on that Ψ + the tp collectives of the GPT's plan."""
    d = sim.tensor_parallel
    mixed = bool(sim.options.get("mixed_precision"))
    value = 2 if mixed else 4
    stage = {"local": 0, "dp": 0, "ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}[sim.strategy]
    group = d["dp"] * sim.options.get("cp", 1)  # the data-parallel strategy reduces over dp x cp
    F = (sim.options.get("sharding_group_size") or group) if sim.strategy == "fsdp" else group
    kept = (4, 4, 8) if sim.strategy == "fsdp" else (value, value, 12 if mixed else 8)
    states = tensor_formulas.tp_model_states(
        d["split"],
        d["replicated"],
        d["tp"],
        F,
        stage,
        param_bytes=kept[0],
        grad_bytes=kept[1],
        optimizer_multiplier=kept[2],
    )
    local = d["split"] / d["tp"] + d["replicated"]
    loop = dict(accumulation=sim.accumulation, no_sync=sim.no_sync)
    wire = formulas.communication_per_step(local, F, sim.strategy, **loop) * value
    if sim.strategy == "fsdp" and F < group:
        wire += formulas.ring_all_reduce_bytes(local / F * value, group // F) * formulas.gradient_reductions(
            sim.strategy, **loop
        )
    if d["tp_bytes"] is not None:
        wire += d["tp_bytes"]["total"]
    return {
        "model_states": states,
        "model_states_total": sum(states.values()),
        "bytes_per_step": wire,
        "flops_6PT": 6 * sim.num_params * sim.batch_per_rank * sim.seq_len / d["tp"],
    }
