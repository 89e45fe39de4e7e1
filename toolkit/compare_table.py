"""The comparison's table: one row per label, its merged Run measured next to what the formulas predict.

A row holds the final loss (and its distance from "local"), the median step time, the peak memory per category
against the model states `compare_theory` predicts, the bytes each rank sent per step against theory, and how
much of the communication hid behind compute. `interpret.notes` explains the rows in words.
"""

from __future__ import annotations

import statistics

from .compare_plan import HSDP_LABEL, MOE_LABEL, plan
from .compare_theory import MODEL, ZERO_STAGE, hsdp_theory, moe_theory, predicted_model_states
from .interpret import collectives_per_step
from .memory import communication_per_step
from .models import tiny_gpt
from .trace.analysis import bytes_per_step, overlap_fraction

NOT_APPLICABLE = "n/a"  # "local": one rank, nothing sent or overlapped; "moe-ep": another model than local's


def summarize(
    label: str,
    run,
    world: int,
    num_params: int,
    mixed_precision: bool,
    local_loss=None,
    *,
    theory_states=None,
    theory_sent=None,
) -> dict:
    """One row of the comparison from a merged Run (theory_*: bytes that replace the formulas' for the
    rows, like "moe-ep", that the ZeRO formulas do not describe)."""
    from .viz.memory import peak_by_category

    losses = [v for _, v in run.metric("loss")]
    times = [v for _, v in run.metric("step_time")]
    peaks = [peak_by_category(run, r) for r in run.ranks]
    states = max(p["params"] + p["grads"] + p["optimizer"] for p in peaks)
    steps = bytes_per_step(run, run.ranks[0])
    sent = statistics.median(s["total"] for s in steps) if steps else 0
    element = 2 if mixed_precision else 4
    theory = (
        communication_per_step(num_params, world, label if label in ZERO_STAGE else "ddp") * element if world > 1 else 0
    )
    theory = theory if theory_sent is None else theory_sent
    if theory_states is None:
        theory_states = predicted_model_states(num_params, world, label, mixed_precision)
    return {
        "strategy": label,
        "ranks": world,
        "final loss": round(losses[-1], 4),
        "|loss - local|": NOT_APPLICABLE if local_loss is None else float(f"{abs(losses[-1] - local_loss):.2e}"),
        "_loss": losses[-1],  # unrounded, for the distance to "local"
        "step ms": round(1e3 * statistics.median(times), 1),
        "collectives/step": collectives_per_step(run, run.ranks[0]) if world > 1 else 0,
        "params MB": round(max(p["params"] for p in peaks) / 1e6, 3),
        "grads MB": round(max(p["grads"] for p in peaks) / 1e6, 3),
        "optimizer MB": round(max(p["optimizer"] for p in peaks) / 1e6, 3),
        "activations MB": round(max(p["activations"] for p in peaks) / 1e6, 3),
        "model states MB": round(states / 1e6, 3),
        "theory MB": round(theory_states / 1e6, 3),
        "sent MB/step": round(sent / 1e6, 3),
        "theory sent MB/step": round(theory / 1e6, 3),
        "overlap": round(overlap_fraction(run), 2) if world > 1 else NOT_APPLICABLE,
    }


def measure(name: str, run, world_size: int, mixed_precision: bool = False, local_loss=None):
    """(the table's row, the predicted model states, the MoE theory or None) of one label's merged Run."""
    num_params = tiny_gpt(**MODEL).num_params()
    world = run.meta["world_size"]
    if name == MOE_LABEL:
        moe = moe_theory(world, plan(name, world_size, 1, mixed_precision)[0], mixed_precision)
        row = summarize(
            name,
            run,
            world,
            moe["num_params"],
            mixed_precision,
            None,
            theory_states=moe["states"],
            theory_sent=moe["sent"],
        )
        return row, moe["states"], moe
    if name == HSDP_LABEL:
        hsdp = hsdp_theory(num_params, world, mixed_precision)
        row = summarize(
            name,
            run,
            world,
            num_params,
            mixed_precision,
            local_loss,
            theory_states=hsdp["states"],
            theory_sent=hsdp["sent"],
        )
        return row, hsdp["states"], None
    row = summarize(name, run, world, num_params, mixed_precision, local_loss)
    return row, predicted_model_states(num_params, world, name, mixed_precision), None
