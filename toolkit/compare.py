"""`python -m toolkit compare`: train the tiny GPT with every strategy and put the numbers side by side.

For each strategy: the same model, seed and global batch; N ranks (one for "local"). A table per
strategy gives the final loss (and its distance from "local"), the step time, the measured peak
memory per category against the ZeRO formula, the bytes each rank sent per step against the theory,
and how much of the communication hid behind compute. The report draws the same as figures, plus a
timeline of one step per strategy; every run's Chrome trace is written too.

"moe-ep" is not a strategy of its own: it trains the MoE-GPT (every MLP an MoE layer, 2 experts per rank,
top-2) with its experts split over the ranks (all-to-all dispatch and combine) while DDP trains the dense
parameters. Its row's theory counts the dense all-reduce plus the all-to-alls under balanced routing, and
the report adds its expert-load figure.

"hsdp" is FSDP with hybrid sharding: units sharded within pairs of ranks and replicated across the pairs
(world size 4: 2 x 2). It needs an even world size of 4 or more and is skipped otherwise. Its theory: model
states of ZeRO-3 over F = 2 ranks, and 3Ψ(F-1)/F sent in the shard group plus a ring all-reduce of the Ψ/F
gradient slice over the W/F replicas.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from . import parallel
from .cli_args import positive_int
from .compare_theory import HSDP_GROUP, MODEL, MOE, ZERO_STAGE, hsdp_theory, moe_theory, predicted_model_states
from .interpret import collectives_per_step, notes
from .memory import communication_per_step
from .models import tiny_gpt
from .runtime.env import default_world_size
from .trace.analysis import bytes_per_step, overlap_fraction
from .trace.chrome import save_chrome
from .train import TrainConfig, launch_train, moe_model_fn

MOE_LABEL = "moe-ep"
HSDP_LABEL = "hsdp"  # strategy fsdp with sharding_group_size=HSDP_GROUP
DEFAULT_STRATEGIES = ("local", "dp", "ddp", "zero1", "zero2", "zero3", "fsdp", HSDP_LABEL, MOE_LABEL)
# Strategy options for a model this small: DDP's default 25 MB bucket would hold the whole model,
# leaving nothing to overlap; a quarter of the gradient bytes gives four buckets.
STRATEGY_OPTIONS = {"ddp": lambda grad_bytes: {"bucket_cap_mb": grad_bytes / 4 / 2**20}}
NOT_APPLICABLE = "n/a"  # "local": one rank, nothing sent or overlapped; "moe-ep": another model than local's


def strategy_files(out_dir, name: str) -> tuple[str, str]:
    """Where a strategy's Chrome trace and Run go: compare-<name>-trace.json, compare-<name>-run.json."""
    return (os.path.join(out_dir, f"compare-{name}-trace.json"), os.path.join(out_dir, f"compare-{name}-run.json"))


def available_strategies(wanted=DEFAULT_STRATEGIES) -> list[str]:
    """The wanted strategies whose implementation exists in this checkout."""
    import importlib

    out = []
    for name in wanted:
        module, _ = (
            ("toolkit.moe.layer", None)
            if name == MOE_LABEL
            else parallel.STRATEGIES["fsdp" if name == HSDP_LABEL else name]
        )
        try:
            importlib.import_module(module)
        except ModuleNotFoundError:
            continue
        out.append(name)
    return out


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


def plan(name: str, world_size: int, steps: int, mixed_precision: bool = False):
    """How a label trains: (TrainConfig, model_fn or None, ranks). The same model, seed and global batch
    for every label; "local" on one rank, the others on `world_size`."""
    num_params = tiny_gpt(**MODEL).num_params()
    strategy = {MOE_LABEL: MOE["strategy"], HSDP_LABEL: "fsdp"}.get(name, name)
    extra = STRATEGY_OPTIONS.get(strategy, lambda _: {})(num_params * (2 if mixed_precision else 4))
    if name == HSDP_LABEL:
        extra = dict(extra, sharding_group_size=HSDP_GROUP)
    options = dict({"mixed_precision": True} if mixed_precision else {}, **extra)
    config = TrainConfig(
        strategy=strategy,
        steps=steps,
        global_batch_size=4 * world_size,
        model=dict(MODEL),
        options=options,
        progress=False,
    )
    model_fn = moe_model_fn(MOE["experts_per_rank"] * world_size, MOE["top_k"]) if name == MOE_LABEL else None
    return config, model_fn, 1 if name == "local" else world_size


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


def training_section(
    world_size: int, strategies, steps: int, say, *, mixed_precision: bool = False, out_dir: str | None = None
):
    """Train each strategy; print the table; return (runs, rows, report blocks)."""
    runs, rows, predicted = {}, [], {}
    local_loss, moe = None, None
    for name in strategies:
        if name == HSDP_LABEL and (world_size % HSDP_GROUP or world_size < 2 * HSDP_GROUP):
            say(
                f"  {name:>6} skipped: hybrid sharding over pairs of ranks needs an even world size >= 4, "
                f"got {world_size}"
            )
            continue
        started = time.perf_counter()
        config, model_fn, world = plan(name, world_size, steps, mixed_precision)
        run = launch_train(config, world, quiet=True, timeout_s=120, model_fn=model_fn)
        row, predicted[name], theory = measure(name, run, world_size, mixed_precision, local_loss)
        moe = theory or moe
        if name == "local":
            local_loss = row["_loss"]
        rows.append(row)
        runs[name] = run
        say(
            f"  {name:>6} on {world} rank(s): loss {row['final loss']:.4f}, {row['step ms']} ms/step, "
            f"model states {row['model states MB']} MB (theory {row['theory MB']}), "
            f"sent {row['sent MB/step']} MB/step (theory {row['theory sent MB/step']}), "
            f"overlap {row['overlap']}  [{time.perf_counter() - started:.0f} s]"
        )
        if out_dir:
            trace_path, run_path = strategy_files(out_dir, name)
            save_chrome(run, trace_path)
            run.save(run_path)
    explained = notes(rows, runs, moe=moe)
    if explained:
        say("What the numbers say:")
        for line in explained:
            say(f"  - {line}")
    return (
        runs,
        rows,
        training_blocks(
            runs,
            rows,
            predicted,
            world_size=world_size,
            steps=steps,
            mixed_precision=mixed_precision,
            moe=moe,
            explained=explained,
        ),
    )


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


def main(argv=None) -> int:
    from . import viz

    parser = argparse.ArgumentParser(prog="python -m toolkit compare", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--world-size",
        type=positive_int,
        default=None,
        help="ranks per strategy, real processes on this machine (default: the GPUs, else 4)",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=8,
        help="training steps per strategy; the step time is their median (default: 8)",
    )
    parser.add_argument(
        "--strategies",
        default=",".join(DEFAULT_STRATEGIES),
        help="comma-separated, in this order (default: %(default)s); hsdp needs an even world of 4 "
        f"or more, {MOE_LABEL} is the expert-parallel MoE-GPT",
    )
    parser.add_argument("--mixed-precision", action="store_true", help="bf16 compute with fp32 master weights")
    parser.add_argument(
        "--out",
        default="runs",
        help="folder for the report (compare-report.html) and each strategy's trace and Run (default: runs)",
    )
    args = parser.parse_args(argv)
    wanted = [s for s in args.strategies.split(",") if s]
    unknown = set(wanted) - set(parallel.STRATEGIES) - {MOE_LABEL, HSDP_LABEL}
    if unknown:
        parser.error(
            f"unknown strategies {sorted(unknown)}; choose from {sorted(parallel.STRATEGIES) + [HSDP_LABEL, MOE_LABEL]}"
        )
    strategies = available_strategies(wanted)
    world = args.world_size or default_world_size()
    os.makedirs(args.out, exist_ok=True)
    print(f"Training {', '.join(strategies)} on {world} ranks, {args.steps} steps each:")
    _, _, blocks = training_section(
        world, strategies, args.steps, print, mixed_precision=args.mixed_precision, out_dir=args.out
    )
    path = os.path.join(args.out, "compare-report.html")
    viz.write_report(path, "toolkit compare: every strategy, measured", blocks)
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
