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

The pieces, in the order they run: `compare_plan.py` (the labels, and how each trains), `compare_table.py`
(each Run measured into the table's row, beside `compare_theory.py`'s formulas) and `compare_report.py` (the
report's figures); here, the loop over the labels and the command line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from . import parallel
from .cli_args import positive_int
from .compare_plan import DEFAULT_STRATEGIES, HSDP_LABEL, MOE_LABEL, available_strategies, plan
from .compare_report import training_blocks
from .compare_table import measure
from .compare_theory import HSDP_GROUP
from .interpret import notes
from .runtime.env import default_world_size
from .trace.chrome import save_chrome
from .train import TrainConfig, launch_train  # noqa: F401 - TrainConfig: `compare.TrainConfig` as before the split


def strategy_files(out_dir, name: str) -> tuple[str, str]:
    """Where a strategy's Chrome trace and Run go: compare-<name>-trace.json, compare-<name>-run.json."""
    return (os.path.join(out_dir, f"compare-{name}-trace.json"), os.path.join(out_dir, f"compare-{name}-run.json"))


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
