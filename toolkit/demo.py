"""`python -m toolkit demo` (`make demo`): the whole toolkit in one command, on this machine.

What it does: launches real ranks, runs every collective through the backend (NCCL or gloo) and
through the hand-written versions (ring, pairwise exchange), checks that both give the same answer,
prints a table of time and bandwidth, and leaves three files under `runs/`:

- `demo-report.html`  the table and interactive figures, self-contained (opens with no network)
- `demo-trace.json`   a Chrome trace: open it in ui.perfetto.dev or chrome://tracing
- `demo-run.json`     the merged Run, to reload with `toolkit.Run.load` and draw again

plus a trace and a Run per trained strategy (`compare-<strategy>-trace.json`, `-run.json`). Without
training (`--quick`, `--no-train`) the three are `demo-collectives-*` instead, so a quick look never
overwrites the full report.

The demo is a sequence of sections: collectives, then training the tiny GPT with every strategy
(`toolkit.compare`: loss, memory against the ZeRO formula, bytes against theory, overlap), each adding
its measurements, table lines and report blocks.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from .comm import measure
from .comm.switch import OPERATIONS
from .compare import available_strategies, strategy_files, training_section
from .runtime.env import default_world_size, resolve_backend
from .trace.chrome import save_chrome

DEMO_SIZES = (4 * measure.KiB, 64 * measure.KiB, 1 * measure.MiB, 4 * measure.MiB)
GPU_SIZES = (64 * measure.KiB, 1 * measure.MiB, 16 * measure.MiB, 64 * measure.MiB)
QUICK_SIZES = measure.QUICK_SIZES


def default_sizes(quick: bool = False) -> tuple:
    if quick:
        return QUICK_SIZES
    return GPU_SIZES if torch.cuda.is_available() and torch.cuda.device_count() > 0 else DEMO_SIZES


# --- section: collectives ------------------------------------------------------------------------------
def collectives_section(world_size: int, sizes, repeats: int, warmup: int, say):
    """Measure every collective both ways; print the table; return (records, run, report blocks, all agreed)."""
    handwritten = measure.handwritten_operations()
    say(
        f"Timing {', '.join(OPERATIONS)} on {world_size} ranks, "
        f"{len(sizes)} sizes, {repeats} repetitions each; backend versus hand-written "
        f"({', '.join(sorted(handwritten)) or 'none yet'})."
    )
    records, run = measure.measure_collectives(
        world_size, sizes=sizes, warmup=warmup, repeats=repeats, config={"demo": "collectives"}
    )
    say("")
    say(measure.format_table(records))
    say("")
    disagree = [r for r in records if r["agree"] is False]
    without = sorted(set(OPERATIONS) - handwritten)
    if disagree:
        say(
            "DISAGREEMENT: "
            + ", ".join(f"{r['op']} at {measure.size_label(r['size_bytes'])}" for r in disagree)
            + " - the hand-written and backend results differ."
        )
    else:
        say("The backend and hand-written results agree wherever both ran.")
    if without:
        say(f"No hand-written version of {', '.join(without)} yet: only the backend was timed for it.")

    return records, run, collectives_blocks(records, run, world_size), not disagree


def collectives_blocks(records, run, world_size: int) -> list:
    """The report's collectives part, from the measurement (nothing runs): the table, bandwidth and time
    against size, the timeline of the largest all-reduce, the ring's schedule."""
    from . import viz

    largest = max(r["size_bytes"] for r in records)
    focus = f"all_reduce/backend/{measure.size_label(largest)}", f"all_reduce/ring/{measure.size_label(largest)}"
    return [
        viz.heading("Every collective, backend versus hand-written"),
        "Each row is the median over repetitions of the slowest rank's time (every repetition starts "
        "after a barrier). algbw = size / time; busbw = algbw × the collective's bus factor "
        "(all-reduce 2(N-1)/N; reduce-scatter, all-gather, all-to-all (N-1)/N; broadcast 1), which is "
        "comparable with the speed of one link.",
        viz.table(measure.table_rows(records)),
        viz.bandwidth(records, model="fit"),
        viz.collective_times(records, model="fit"),
        viz.heading("Timeline"),
        "One all-reduce of the largest size, backend then ring, on every rank. Hover a span for its "
        "bytes, duration and bandwidth; drag to zoom.",
        viz.timeline(run, phase=focus, title=f"all-reduce of {measure.size_label(largest)}: backend, then ring"),
        viz.timeline(run, title="The whole measurement (zoom in: every bar is one call)"),
        viz.heading("The ring's schedule"),
        viz.ring_schedule(world_size),
    ]


# --- the files ------------------------------------------------------------------------------------------
def files_section(paths: dict, strategies, out_dir) -> list:
    """The report's last section: every file this demo wrote beside it, and how to open each."""
    from . import viz

    rows = [
        {"file": os.path.basename(paths["report"]), "what": "this report (self-contained, opens offline)"},
        {
            "file": os.path.basename(paths["trace"]),
            "what": "the collectives' Chrome trace: open it in ui.perfetto.dev or chrome://tracing",
        },
        {
            "file": os.path.basename(paths["run"]),
            "what": "the collectives' Run: toolkit.Run.load(path), then toolkit.viz.timeline(run)",
        },
    ]
    for name in strategies:
        trace, run = strategy_files(out_dir, name)
        rows += [
            {"file": os.path.basename(trace), "what": f"{name}: Chrome trace of its training steps"},
            {"file": os.path.basename(run), "what": f"{name}: its merged Run (every rank)"},
        ]
    return [viz.heading("Files"), f"Written to {os.path.abspath(out_dir)}:", viz.table(rows)]


def write_demo_report(paths: dict, run, blocks, strategies, out_dir, *, seconds: float) -> str:
    """The demo's report: what ran where, the sections' blocks, and the files; returns its path."""
    from . import viz

    meta, cores = run.meta, os.cpu_count() or 1
    summary = (
        f"{meta.get('world_size')} ranks, backend {meta.get('backend')}, device {meta.get('device')}, torch "
        f"{meta.get('torch')}, host {meta.get('host')}, {cores} CPU cores; measured in {seconds:.1f} s."
    )
    return viz.write_report(
        paths["report"],
        "toolkit demo: collectives and training strategies, measured live",
        [
            summary,
            viz.note(
                "Times on a shared or oversubscribed machine are upper bounds; "
                "compare the implementations with each other, measured side by "
                "side."
            ),
        ]
        + blocks
        + files_section(paths, strategies, out_dir),
    )


# --- the demo ------------------------------------------------------------------------------------------
def run_demo(
    world_size: int | None = None,
    out_dir="runs",
    sizes=None,
    quick: bool = False,
    repeats: int | None = None,
    say=print,
    train: bool | None = None,
    train_steps: int = 6,
) -> dict:
    """Run the demo; return the paths written: {"report", "trace", "run"} (plus "ok": did everything agree).

    quick: two sizes and three repetitions (for tests and a first look). sizes: message sizes in bytes.
    train: also train the tiny GPT with every strategy (`toolkit.compare`); default: unless quick.
    Its traces and Runs go to `compare-<strategy>-trace.json` / `-run.json` beside the others. The
    demo's own files are `demo-*` with training and `demo-collectives-*` without.
    """
    train = (not quick) if train is None else train
    started = time.perf_counter()
    world_size = world_size or default_world_size()
    sizes = tuple(sizes or default_sizes(quick))
    repeats = repeats or (3 if quick else 5)
    cores = os.cpu_count() or 1
    backend = resolve_backend("auto", world_size)
    say(
        f"toolkit demo: {world_size} ranks ({backend}) on a machine with {cores} CPU cores"
        + (f" and {torch.cuda.device_count()} GPUs" if torch.cuda.is_available() else "")
        + "."
    )
    if backend == "gloo" and world_size > cores:
        say(
            f"{world_size} ranks share {cores} cores: they take turns, so times are upper bounds and "
            "bandwidths lower bounds; compare implementations side by side, not with a datasheet."
        )

    records, run, blocks, ok = collectives_section(world_size, sizes, repeats, 1, say)

    os.makedirs(out_dir, exist_ok=True)
    trained = []
    if train:
        say("")
        say(f"Training the tiny GPT with every strategy on {world_size} ranks ({train_steps} steps each):")
        runs, _, training_blocks = training_section(
            world_size, available_strategies(), train_steps, say, out_dir=out_dir
        )
        blocks += training_blocks
        trained = list(runs)
    stem = "demo" if train else "demo-collectives"
    paths = {
        kind: os.path.join(out_dir, f"{stem}-{kind}.{ext}")
        for kind, ext in (("report", "html"), ("trace", "json"), ("run", "json"))
    }
    run.save(paths["run"])
    save_chrome(run, paths["trace"])
    write_demo_report(paths, run, blocks, trained, out_dir, seconds=time.perf_counter() - started)
    say("")
    for label, path in paths.items():
        say(f"{label:>6}: {path}")
    if trained:
        say(f" and a trace and a Run per strategy: {strategy_files(out_dir, '<strategy>')[0]}, ...")
    elif os.path.exists(os.path.join(out_dir, "demo-report.html")):
        say(f"(collectives only; the full report of `make demo` is still {os.path.join(out_dir, 'demo-report.html')})")
    say(f"done in {time.perf_counter() - started:.1f} s")
    return dict(paths, ok=ok)


def main(argv=None) -> int:
    """The command line of `python -m toolkit demo`; returns 0 when every comparison agreed."""
    parser = argparse.ArgumentParser(prog="python -m toolkit demo", description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=None, help="ranks to launch (default: one per GPU, else 4)")
    parser.add_argument("--out", default="runs", help="folder for the report, trace and run (default: runs)")
    parser.add_argument(
        "--quick", action="store_true", help="two sizes, three repetitions, no training: a first look in seconds"
    )
    parser.add_argument("--no-train", action="store_true", help="collectives only: skip training the strategies")
    parser.add_argument("--steps", type=int, default=6, help="training steps per strategy (default: 6)")
    args = parser.parse_args(argv)
    if args.world_size is not None and args.world_size < 2:
        parser.error("--world-size must be at least 2: a collective needs someone to talk to.")
    result = run_demo(
        world_size=args.world_size,
        out_dir=args.out,
        quick=args.quick,
        train=False if args.no_train else None,
        train_steps=args.steps,
    )
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
