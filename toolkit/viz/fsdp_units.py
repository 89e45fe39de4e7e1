"""What a wrap policy costs FSDP, predicted without launching: its units, their padding, memory and collectives.

The units come from the same code FSDP itself uses (`toolkit.parallel.fsdp_policy.plan`: the wrap policy,
the root taking what is left, tied weights moved to their lowest common ancestor), run on one process on
a model that may live on the meta device (shapes only: a 1.5B-parameter GPT costs nothing to build).
From the units and the number of ranks N it predicts, per rank:

- each unit's flat parameter: elements, padding to a multiple of N (< N per unit), elements per shard;
- peak memory of the model states (bytes, fp32 AdamW as in `toolkit.parallel.fsdp`):
      16 B x Σ padded_i / N               the shards: fp32 master 4 + gradient 4 + AdamW moments 8
    + (4 + 4) B x root                    the root unit encloses the whole forward: it stays gathered,
                                          and its full gradient lives through backward
    + 4 B x in-flight units               the largest unit gathered (with its enclosing units), plus
                                          the next one when it is prefetched
    + 4 B x full gradients in flight      one unit's gradient filling, the previous one's reduce-scatter
  This is the FSDP paper's "sharded model plus the largest fully materialized unit(s)", spelled out for
  this implementation; `tests/test_fsdp.py` checks the measured peak against it;
- collectives per step: 2 all-gathers + 1 reduce-scatter per unit, and the bytes they send,
  3 Σ padded_i (N-1)/N x 4 B, with an alpha-beta estimate of their time (the latency term grows with
  the number of units: many small units waste the link).

`policy_numbers(...)` is pure (tested without a screen); `fsdp_explorer.py` is the panel that shows it.
"""

from __future__ import annotations

import torch.nn as nn

from ..memory.formulas import alpha_beta_time
from ..parallel.flat import padded_numel
from ..parallel.fsdp_policy import UnitPlan, plan

WHOLE_MODEL = "whole model"
SHARD_BYTES = 16  # per element of a shard: fp32 master 4 + fp32 gradient 4 + AdamW moments 8
PARAM_BYTES = GRAD_BYTES = 4  # fp32 gathered parameters and full gradients
ALPHA, BANDWIDTH = 20e-6, 25e9  # a link for the time estimate: 20 µs per message, 25 GB/s


def units_of(model: nn.Module, policy=None) -> list[UnitPlan]:
    """FSDP's units for `policy` (see fsdp_policy.py), or one root unit for WHOLE_MODEL."""
    if isinstance(policy, str) and policy == WHOLE_MODEL:
        params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
        return [UnitPlan("", model, params)]
    return plan(model, policy)


def _chain(name: str, names: list[str], sizes: dict) -> int:
    """Elements gathered while unit `name` computes: it and every non-root unit enclosing it."""
    return sum(sizes[n] for n in names if n == name or name.startswith(n + "."))


def policy_numbers(
    model: nn.Module,
    policy=None,
    world_size: int = 8,
    *,
    prefetch: bool = True,
    alpha: float = ALPHA,
    bandwidth: float = BANDWIDTH,
) -> dict:
    """What the explorer shows for `model` cut into units by `policy`, sharded over `world_size` ranks.

    Returns {"units": [{unit, tensors, numel, padded_numel, padding, shard_numel}] (root first), "numel",
    "padding", "memory": {sharded, root, in_flight, full_grads, peak, ddp} in bytes per rank,
    "collectives": {all_gather, reduce_scatter, total} per step, "bytes_sent" per rank per step,
    "comm_s" and "latency_s" (alpha-beta estimate of the step's collectives, and its latency part)}.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}.")
    plans = units_of(model, policy)
    rows = []
    for p in plans:
        numel = sum(t.numel() for t in p.params)
        padded = padded_numel(numel, world_size)
        rows.append(
            {
                "unit": p.name or "(root)",
                "tensors": len(p.params),
                "numel": numel,
                "padded_numel": padded,
                "padding": padded - numel,
                "shard_numel": padded // world_size,
            }
        )
    root = rows[0]["padded_numel"] if plans[0].name == "" else 0
    inner = [r for r, p in zip(rows, plans) if p.name]
    names = [r["unit"] for r in inner]
    sizes = {r["unit"]: r["padded_numel"] for r in inner}
    largest = max(sizes.values(), default=0)
    gathered = max((_chain(n, names, sizes) for n in names), default=0)
    if prefetch and len(inner) > 1:
        gathered += largest  # the next unit's all-gather is issued while this one computes
    full_grads = largest * min(2, len(inner))  # one filling, the previous one reduce-scattering
    total_padded = sum(r["padded_numel"] for r in rows)
    N = world_size
    memory = {
        "sharded": SHARD_BYTES * total_padded / N if N > 1 else SHARD_BYTES * total_padded,
        "root": (PARAM_BYTES + GRAD_BYTES) * root if N > 1 else 0,
        "in_flight": PARAM_BYTES * gathered if N > 1 else 0,
        "full_grads": GRAD_BYTES * full_grads if N > 1 else 0,
    }
    memory["peak"] = sum(memory.values())
    memory["ddp"] = SHARD_BYTES * sum(r["numel"] for r in rows)  # every rank holds everything
    beta = 1 / bandwidth
    comm = latency = 0.0
    for r in rows:  # forward all-gather, backward all-gather, reduce-scatter
        size = r["padded_numel"] * PARAM_BYTES
        for op in ("all_gather", "all_gather", "reduce_scatter"):
            comm += alpha_beta_time(op, size, N, alpha, beta)
            latency += alpha_beta_time(op, size, N, alpha, 0.0)
    U = len(rows) if N > 1 else 0
    return {
        "units": rows,
        "numel": sum(r["numel"] for r in rows),
        "padding": sum(r["padding"] for r in rows),
        "world_size": N,
        "prefetch": prefetch,
        "memory": memory,
        "collectives": {"all_gather": 2 * U, "reduce_scatter": U, "total": 3 * U},
        "bytes_sent": 3 * total_padded * (N - 1) / N * PARAM_BYTES,
        "comm_s": comm,
        "latency_s": latency,
    }
