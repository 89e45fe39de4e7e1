"""The report's training part, drawn from the Runs and the table's rows (nothing runs here).

The table and what it says, memory and bytes sent against the theory (`viz.memory`), the last step of each
strategy on every rank (`viz.timeline`) and, for "moe-ep", where the MoE-GPT's tokens went (`viz.expert_load`).
"""

from __future__ import annotations

from .compare_plan import MOE_LABEL
from .compare_theory import MODEL, MOE
from .models import tiny_gpt


def training_blocks(
    runs,
    rows,
    predicted,
    *,
    world_size: int,
    steps: int,
    mixed_precision: bool = False,
    moe: dict | None = None,
    explained=(),
) -> list:
    """The report's training part, from the Runs and rows (nothing runs): the table, what it says,
    memory and bytes against the theory, the last step of each strategy, the MoE's expert load."""
    from . import viz
    from .viz.memory import comm_bars, memory_bars

    num_params = tiny_gpt(**MODEL).num_params()
    blocks = [
        viz.heading("Training the tiny GPT with every strategy"),
        f"Tiny GPT {MODEL}, {num_params:,} parameters, {steps} AdamW steps, global batch {4 * world_size} rows "
        f"split over {world_size} ranks ('local' trains the whole batch in one process: the oracle). "
        + (
            "Mixed precision (bf16 compute, fp32 masters): theory 2 + 2 + 12 bytes per parameter."
            if mixed_precision
            else "fp32: theory 4 + 4 + 8 bytes per parameter (AdamW's two moments)."
        ),
        viz.table([{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]),
        viz.bullets(explained),
        memory_bars(runs, predicted, unit=1e6),  # in the table's unit (its columns are MB)
        comm_bars(
            [
                {
                    "strategy": r["strategy"],
                    "measured": r["sent MB/step"] * 1e6,
                    "theory": r["theory sent MB/step"] * 1e6,
                }
                for r in rows
                if r["ranks"] > 1
            ],
            unit=1e6,
        ),
    ]
    overlaps = {r["strategy"]: r["overlap"] for r in rows}
    for name, run in runs.items():
        if run.meta["world_size"] > 1:
            table = overlaps.get(name)
            note = (
                f"the table's overlap, {table:.0%}, pools every rank over the whole run ({steps} steps and the set-up)"
                if isinstance(table, float)
                else None
            )
            blocks.append(
                viz.timeline(
                    run,
                    where=lambda e, s=steps - 1, r=run: _in_step(e, r, s),
                    title=f"{name}: the last step on every rank",
                    note=note,
                )
            )
    if moe is not None and MOE_LABEL in runs:
        blocks += _moe_blocks(runs[MOE_LABEL], moe, world_size)
    return blocks


def _moe_blocks(run, moe: dict, world: int) -> list:
    """The report's MoE part: what the "moe-ep" row trained, and where its tokens went."""
    from . import viz

    E = MOE["experts_per_rank"] * world
    return [
        viz.heading("The MoE-GPT with expert parallelism (moe-ep)"),
        f"The same GPT with every MLP replaced by an MoE layer of {E} experts (top-{MOE['top_k']}, capacity "
        f"factor 1.25): {moe['num_params']:,} parameters, of which {moe['experts']:,} in experts, "
        f"{moe['experts_per_rank']:,} per rank. Each rank holds {MOE['experts_per_rank']} experts per layer and "
        f"sends tokens to the others with all-to-alls (on the timeline above: counts, dispatch, combine, and "
        f"their backward); DDP all-reduces only the {moe['dense']:,} dense parameters' gradients. Its loss is "
        "not comparable with the dense rows' (another model), hence no |loss - local|.",
        viz.expert_load(run),
    ]


def _in_step(event, run, step: int) -> bool:
    from .trace.analysis import step_windows

    windows = step_windows(run, event["rank"])
    if step >= len(windows):
        return True
    start, end = windows[step]
    return start <= event["start"] <= end
