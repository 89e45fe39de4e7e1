"""How far to trust the simulator's step time: its prediction next to a measurement, on this machine, in one run.

For each world size: calibrate the "this-machine" preset (`toolkit.sim.calibrate`: GEMM FLOP/s by size,
per-operation overhead, memory bandwidth and the loopback alpha-beta of every collective, all measured with
every rank busy; nothing fitted to a step), then for each strategy

- predict: `toolkit.sim.simulate` runs the strategy's own code for one rank on the fake process group
  (meta tensors) and the cost model prices its program on the calibrated preset;
  Under tensor or pipeline parallelism (the "x tp 2" and "x pp 2" rows) a data-parallel replica spans 2
  ranks and computes the 8 sequences a rank computes alone; a pipelined rank is priced with its pipeline.
- measure: the same model and strategy train for real on gloo ranks; a step's time is the slowest
  rank's, and the reported time is the median over steps. The strategies take their steps in turn
  (ddp, zero1, ..., ddp, zero1, ...) so that the shared machine's slow moments hit all of them, and
  with them the calibration's reference step: how much faster or slower it runs than while calibrating
  is the change in the machine's load, and the compute rates are scaled by it (a measurement, not a fit).
  The load average during calibration and during the run is reported beside.

Reported: both times, the error (predicted / measured - 1), and whether ranking the strategies by
step time gives the same order. The target is every error within 20% and the ranking preserved; a miss
is explained by what the model leaves out, never fixed with a per-case factor. MoE: one MoE layer
(expert parallel over all ranks) on an emulated link (`toolkit.comm.emulate`), plain, pipelined and
shadowing, predicted with the emulated link's alpha-beta in place of the loopback's (a one-block MoE GPT,
SGD, no gradient synchronisation: what is measured is the layer's all-to-alls and experts).

The cases are in `sim_accuracy_cases.py`, the measurements in `sim_accuracy_measure.py`, the report's table
in `sim_accuracy_report.py`; here, the predictions and the run that puts them side by side.

    python bench/sim_accuracy.py [--world-sizes 2,4] [--steps 8] [--cached] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import sys

import benchlib  # bench/benchlib.py (a bench runs as a script: its folder is on sys.path)
import torch
from sim_accuracy_cases import CONFIGS, MODEL, MOE, MOE_VARIANTS, PER_RANK_BATCH, moe_block, skewed
from sim_accuracy_measure import measure_moe, measure_strategies
from sim_accuracy_report import as_before, how_priced, ranking, table

import toolkit

SECTION = "## Simulator accuracy on this machine (bench/sim_accuracy.py)"


# --- predicting (in this process) ----------------------------------------------------------------------------
def predict_strategies(configs, world: int, machine) -> dict:
    from toolkit.models import tiny_gpt
    from toolkit.sim import simulate

    out = {}
    for name, (strategy, options) in configs.items():
        sim = simulate(
            functools.partial(tiny_gpt, **MODEL),
            strategy,
            world,
            ranks_per_node=world,
            batch_per_rank=PER_RANK_BATCH,
            cluster=machine,
            progress=False,
            **options,
        )
        out[name] = sim
    return out


def predict_moe(variants, world: int, machine) -> dict:
    """Each variant simulated on every rank (their loads differ: capacity caps the hot expert, so at 4 ranks rank 0
    is not the busiest), the slowest rank's kept: a step ends when the slowest rank's does, and the measurement is
    the slowest rank's. A variant the simulator cannot run yet maps to the reason."""
    from toolkit.sim import simulate

    out = {}
    for name, options in variants.items():
        try:
            ranks = [
                simulate(
                    functools.partial(moe_block, world, **options),
                    "local",
                    world,
                    rank=rank,
                    ranks_per_node=1,
                    batch_per_rank=MOE["batch"],
                    optimizer=torch.optim.SGD,
                    routing=skewed,
                    cluster=machine,
                    progress=False,
                )
                for rank in range(world)
            ]
            out[name] = max(ranks, key=lambda sim: sim.step_time)
        except (RuntimeError, ValueError, NotImplementedError) as exc:
            out[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return out


def run_world(world: int, steps: int, cached: bool, with_moe: bool, calibrations: int = 2) -> tuple[str, list]:
    """Calibrate `calibrations` times (their spread is how far one calibration's constants move), measure the
    strategies once, predict with the first calibration (the rest priced on the same simulated programs)."""
    from toolkit.sim import price
    from toolkit.sim.calibrate import from_measurements, this_machine

    found = [
        this_machine(world, refresh=not cached or i > 0, quiet=False).notes["measurements"] for i in range(calibrations)
    ]
    measured = toolkit.launch(measure_strategies, world, args=(CONFIGS, steps), timeout_s=600, quiet=True)[0]
    reference = measured.pop("reference")
    machines = [from_measurements(m, reference_step_s=reference) for m in found]
    machine = machines[0]
    sims = predict_strategies(CONFIGS, world, machine)
    world_fit = machine.with_changes(op_links={op: v for op, v in machine.op_links.items() if isinstance(op, str)})
    rows = [
        {
            "name": f"{name} x{world}",
            "predicted": sims[name].step_time,
            "measured": measured[name],
            "breakdown": sims[name].breakdown,
            "each": [price(sims[name], mc).step_time for mc in machines],
            "flat": price(
                sims[name], machine.with_changes(beside_compute=found[0]["beside_compute"]["stretch"])
            ).step_time,
            "queued": price(sims[name], machine.with_changes(collective_lanes=1)).step_time,
            "world_fit": price(sims[name], world_fit).step_time,
        }
        for name in CONFIGS
    ]
    text = table(world, machine, rows)
    text += "\n\nRanking by step time: " + ranking({n: sims[n].step_time for n in CONFIGS}, measured) + "."
    predicted = {}
    if with_moe:
        link = toolkit.comm.emulate(bandwidth=MOE["bandwidth"], latency=MOE["latency"])
        try:
            emulated = from_measurements(found[0], toolkit.comm.emulated_link(), reference_step_s=reference)
            predicted = predict_moe(MOE_VARIANTS, world, emulated)
            moe_measured = toolkit.launch(measure_moe, world, args=(MOE_VARIANTS, steps), timeout_s=600, quiet=True)[0]
        finally:
            link.__exit__()
        moe_rows = [
            {
                "name": f"{name} x{world}",
                "predicted": predicted[name].step_time,
                "measured": moe_measured[name],
                "breakdown": predicted[name].breakdown,
                "queued": price(predicted[name], emulated.with_changes(underlay=None)).step_time,
                "together": price(predicted[name], emulated.with_changes(late_peers=())).step_time,
            }
            for name in MOE_VARIANTS
            if not isinstance(predicted[name], str)
        ]
        missing = {name: why for name, why in predicted.items() if isinstance(why, str)}
        rows += moe_rows
        text += (
            f"\n\nMoE layer ({MOE['experts_per_rank']} experts per rank, {MOE['batch'] * MOE['seq_len']} tokens "
            f"per rank, d_model {MOE['d_model']}, d_ff {MOE['d_ff']}, top-{MOE['top_k']}) on an emulated link of "
            f"{MOE['bandwidth']}, {MOE['latency']} per message, forward + backward:\n\n"
            + table(world, machine, moe_rows).split("\n", 2)[2]
            + "".join(
                f"\n| {name} x{world} | not simulated | {moe_measured[name] * 1e3:.1f} | - | {why} |"
                for name, why in missing.items()
            )
            + "\n\nRanking: "
            + ranking({r["name"]: r["predicted"] for r in moe_rows}, {r["name"]: r["measured"] for r in moe_rows})
            + "."
        )
    return text + "\n\n" + how_priced(world, machine, predicted), rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--cached", action="store_true", help="reuse a cached calibration instead of measuring again")
    parser.add_argument("--no-moe", action="store_true")
    parser.add_argument("--calibrations", type=int, default=2, help="calibrate this many times: their spread")
    parser.add_argument("--write", help="put the section into this markdown file")
    args = parser.parse_args(argv)
    header = (
        f"gloo on CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), torch "
        f"{torch.__version__}; tiny GPT {MODEL}, {PER_RANK_BATCH} sequences per rank, AdamW, fp32. "
        f"Target: every error within 20%, ranking preserved."
    )
    parts, rows = [header], []
    for world in (int(w) for w in args.world_sizes.split(",") if w):
        text, got = run_world(world, args.steps, args.cached, not args.no_moe, args.calibrations)
        parts.append(text)
        rows += got
    worst = max(rows, key=lambda r: abs(r["predicted"] / r["measured"] - 1))
    within = sum(abs(r["predicted"] / r["measured"] - 1) <= 0.2 for r in rows)
    parts.append(
        f"{within} of {len(rows)} predictions within 20%; the worst is {worst['name']} "
        f"({worst['predicted'] / worst['measured'] - 1:+.0%}). " + as_before(rows)
    )
    body = "\n\n".join(parts)
    print(body)
    if args.write:
        benchlib.write_section(args.write, SECTION, f".venv/bin/python {' '.join(sys.argv)}", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
