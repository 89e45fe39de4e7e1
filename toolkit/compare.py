"""`python -m toolkit compare`: train the tiny GPT with every strategy and put the numbers side by side.

For each strategy: the same model, seed and global batch; N ranks (one for "local"). A table per
strategy gives the final loss (and its distance from "local"), the step time, the measured peak
memory per category against the ZeRO formula, the bytes each rank sent per step against the theory,
and how much of the communication hid behind compute. The report draws the same as figures, plus a
timeline of one step per strategy; every run's Chrome trace is written too.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from . import parallel
from .memory import communication_per_step, model_states
from .trace.analysis import bytes_per_step, overlap_fraction
from .trace.chrome import save_chrome
from .train import TrainConfig, launch_train

DEFAULT_STRATEGIES = ("local", "dp", "ddp", "zero1", "zero2", "zero3")
ZERO_STAGE = {"local": 0, "dp": 0, "ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}
MODEL = dict(n_layer=2, d_model=64, n_head=4)
# Strategy options for a model this small: DDP's default 25 MB bucket would hold the whole model,
# leaving nothing to overlap; a quarter of the gradient bytes gives four buckets.
STRATEGY_OPTIONS = {"ddp": lambda grad_bytes: {"bucket_cap_mb": grad_bytes / 4 / 2**20}}


def available_strategies(wanted=DEFAULT_STRATEGIES) -> list[str]:
    """The wanted strategies whose implementation exists in this checkout."""
    import importlib

    out = []
    for name in wanted:
        module, _ = parallel.STRATEGIES[name]
        try:
            importlib.import_module(module)
        except ModuleNotFoundError:
            continue
        out.append(name)
    return out


def predicted_model_states(num_params: int, world: int, strategy: str, mixed_precision: bool) -> float:
    """The formula's bytes per rank for params + grads + optimizer under this strategy.

    fp32 AdamW: 4 + 4 + 8 bytes per parameter (no separate master copy); mixed precision: 2 + 2 + 12.
    """
    if mixed_precision:
        return model_states(num_params, world, ZERO_STAGE[strategy])
    return model_states(num_params, world, ZERO_STAGE[strategy], param_bytes=4, grad_bytes=4, optimizer_multiplier=8)


def summarize(label: str, run, world: int, num_params: int, mixed_precision: bool, local_loss=None) -> dict:
    """One row of the comparison from a merged Run."""
    from .viz.memory import peak_by_category

    losses = [v for _, v in run.metric("loss")]
    times = [v for _, v in run.metric("step_time")]
    peaks = [peak_by_category(run, r) for r in run.ranks]
    states = max(p["params"] + p["grads"] + p["optimizer"] for p in peaks)
    steps = bytes_per_step(run, run.ranks[0])
    sent = statistics.median(s["total"] for s in steps) if steps else 0
    element = 2 if mixed_precision else 4
    theory = communication_per_step(num_params, world, label if label in ZERO_STAGE else "ddp") * element \
        if world > 1 else 0
    return {"strategy": label, "ranks": world, "final loss": round(losses[-1], 4),
            "|loss - local|": None if local_loss is None else float(f"{abs(losses[-1] - local_loss):.2e}"),
            "step ms": round(1e3 * statistics.median(times), 1),
            "params MB": round(max(p["params"] for p in peaks) / 1e6, 3),
            "grads MB": round(max(p["grads"] for p in peaks) / 1e6, 3),
            "optimizer MB": round(max(p["optimizer"] for p in peaks) / 1e6, 3),
            "activations MB": round(max(p["activations"] for p in peaks) / 1e6, 3),
            "model states MB": round(states / 1e6, 3),
            "theory MB": round(predicted_model_states(num_params, world, label, mixed_precision) / 1e6, 3),
            "sent MB/step": round(sent / 1e6, 3), "theory sent MB/step": round(theory / 1e6, 3),
            "overlap": round(overlap_fraction(run), 2) if world > 1 else None}


def training_section(world_size: int, strategies, steps: int, say, *, mixed_precision: bool = False,
                     out_dir: str | None = None):
    """Train each strategy; print the table; return (runs, rows, report blocks)."""
    from . import viz
    from .models import tiny_gpt
    from .viz.memory import comm_bars, memory_bars

    options = {"mixed_precision": True} if mixed_precision else {}
    runs, rows, predicted = {}, [], {}
    num_params = tiny_gpt(**MODEL).num_params()
    local_loss = None
    for name in strategies:
        world = 1 if name == "local" else world_size
        extra = STRATEGY_OPTIONS.get(name, lambda _: {})(num_params * (2 if mixed_precision else 4))
        config = TrainConfig(strategy=name, steps=steps, global_batch_size=4 * world_size, model=dict(MODEL),
                             options=dict(options, **extra), progress=False)
        started = time.perf_counter()
        run = launch_train(config, world, quiet=True, timeout_s=120)
        row = summarize(name, run, world, num_params, mixed_precision, local_loss)
        if name == "local":
            local_loss = row["final loss"]
        rows.append(row)
        runs[name] = run
        predicted[name] = predicted_model_states(num_params, world, name, mixed_precision)
        say(f"  {name:>6} on {world} rank(s): loss {row['final loss']:.4f}, {row['step ms']} ms/step, "
            f"model states {row['model states MB']} MB (theory {row['theory MB']}), "
            f"sent {row['sent MB/step']} MB/step (theory {row['theory sent MB/step']}), "
            f"overlap {row['overlap']}  [{time.perf_counter() - started:.0f} s]")
        if out_dir:
            save_chrome(run, os.path.join(out_dir, f"compare-{name}-trace.json"))
            run.save(os.path.join(out_dir, f"compare-{name}-run.json"))
    last_step = steps - 1
    blocks = [
        viz.heading("Training the tiny GPT with every strategy"),
        f"Tiny GPT {MODEL}, {num_params:,} parameters, {steps} AdamW steps, global batch {4 * world_size} rows "
        f"split over {world_size} ranks ('local' trains the whole batch in one process: the oracle). "
        + ("Mixed precision (bf16 compute, fp32 masters): theory 2 + 2 + 12 bytes per parameter."
           if mixed_precision else "fp32: theory 4 + 4 + 8 bytes per parameter (AdamW's two moments)."),
        viz.table(rows),
        memory_bars(runs, predicted),
        comm_bars([{"strategy": r["strategy"], "measured": r["sent MB/step"] * 1e6,
                    "theory": r["theory sent MB/step"] * 1e6} for r in rows if r["ranks"] > 1]),
    ]
    for name, run in runs.items():
        if run.meta["world_size"] > 1:
            blocks.append(viz.timeline(run, where=lambda e, s=last_step: _in_step(e, run, s),
                                       title=f"{name}: the last step on every rank"))
    return runs, rows, blocks


def _in_step(event, run, step: int) -> bool:
    from .trace.analysis import step_windows

    windows = step_windows(run, event["rank"])
    if step >= len(windows):
        return True
    start, end = windows[step]
    return start <= event["start"] <= end


def main(argv=None) -> int:
    from . import viz
    from .demo import default_world_size

    parser = argparse.ArgumentParser(prog="python -m toolkit compare", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=None, help="ranks per strategy (default: GPUs, else 4)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES))
    parser.add_argument("--mixed-precision", action="store_true", help="bf16 compute with fp32 master weights")
    parser.add_argument("--out", default="runs")
    args = parser.parse_args(argv)
    wanted = [s for s in args.strategies.split(",") if s]
    unknown = set(wanted) - set(parallel.STRATEGIES)
    if unknown:
        parser.error(f"unknown strategies {sorted(unknown)}; choose from {sorted(parallel.STRATEGIES)}")
    strategies = available_strategies(wanted)
    world = args.world_size or default_world_size()
    os.makedirs(args.out, exist_ok=True)
    print(f"Training {', '.join(strategies)} on {world} ranks, {args.steps} steps each:")
    _, _, blocks = training_section(world, strategies, args.steps, print, mixed_precision=args.mixed_precision,
                                    out_dir=args.out)
    path = os.path.join(args.out, "compare-report.html")
    viz.write_report(path, "toolkit compare: every strategy, measured", blocks)
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
