"""How fast the simulated cluster is, and the papers' numbers from the full-depth models.

Target (issue 10): GPT-3 175B under zero3 at 512 ranks, one step, in <= 60 s and <= 4 GB of RAM on
2 cores. Each case runs in a fresh child process, so its peak resident memory (ru_maxrss) is its own.
`--profile` runs the target once more under cProfile and prints the time inside each tracker's dispatch
(MemTracker, the op counter): where the time goes. The target also runs without known shapes
(`toolkit.sim.known_shapes`: every meta operation's outputs computed by torch, as before they were
memoized), side by side, so the table holds what memoizing saves as a ratio.

    python bench/sim_speed.py            # the 175B target, then ZeRO Figure 1 and GPT-3 at full depth
    python bench/sim_speed.py --quick    # the target case only
    python bench/sim_speed.py --write docs/benchmarks.md   # and put the tables there
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GB = 1e9
NOTES = """The simulation runs on one core. Its CPU seconds (time.process_time of the child) hardly move with
the machine's load; wall-clock seconds do (other sessions share these 2 cores: the same step has taken
12 to 85 s of wall time at load averages of 5 to 10). Peak RSS is the child process's own. cProfile
(`--profile`) put most of the time in per-operation Python: torch's meta kernels (prims and refs: a layer
norm's backward about 3 ms on meta), and the two dispatch modes that watch every operation (MemTracker,
the op counter, which also counts FLOPs); the toolkit's strategies themselves are a small share. Known
shapes (`toolkit.sim.known_shapes`) now answer a meta operation already run on the same shapes with fresh
tensors, and the op counter reuses its kernel records by the same key: the second row is the same
simulation with both turned off, side by side (the same peak, bytes and FLOPs). ZeRO-3's step is the
slowest because every module is a unit (about six all-gathers, waits and frees per layer and pass). Model
states and bytes equal the formulas on the model's own parameter count (padding below 0.01 GB); the peak
adds what one moment of the step holds: gathered units, activations of the sequence, gradients on their
way to a reduce-scatter (one reduction's input at a time: ZeRO-2/3 and FSDP finish each before starting
the next)."""


def _case(queue, model, strategy, world, options, profile, known_shapes=True):
    import cProfile
    import pstats

    from toolkit.models import presets
    from toolkit.sim import simulate

    if not known_shapes:  # torch computes every meta operation's outputs; the op counter every kernel record
        from toolkit.sim import known_shapes as memo

        memo.ENABLED = False

    profiler = cProfile.Profile() if profile else None
    start, cpu = time.perf_counter(), time.process_time()
    if profiler:
        profiler.enable()
    sim = simulate(getattr(presets, model), strategy, world, progress=True, **options)
    if profiler:
        profiler.disable()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    split = {}
    if profiler:
        stats = pstats.Stats(profiler).stats
        for (path, _, name), (_, _, _, cumulative, _) in stats.items():
            for key, where in (("MemTracker", "mem_tracker.py"), ("op counter", "sim/record.py")):
                if path.endswith(where) and name == "__torch_dispatch__":
                    split[key] = split.get(key, 0.0) + cumulative
    queue.put(
        {
            "seconds": seconds,
            "cpu": cpu,
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "split": split,
            "num_params": sim.num_params,
            "memory": sim.memory["total"],
            "peak": sim.peak,
            "bytes": sim.bytes_per_step["total"],
            "cross": sim.cross_node_bytes,
            "flops": sim.flops,
            "theory": sim.theory(),
            "moment": sim.peak_moment,
        }
    )


def run_case(model, strategy, world, options, profile=False, known_shapes=True) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_case, args=(queue, model, strategy, world, options, profile, known_shapes))
    child.start()
    result = queue.get()
    child.join()
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the 175B target case")
    parser.add_argument("--profile", action="store_true", help="also profile the target case (cProfile)")
    parser.add_argument("--write", default=None, help="put the tables into this markdown file (docs/benchmarks.md)")
    args = parser.parse_args(argv)
    mixed = {"mixed_precision": True}
    target = run_case("gpt3_175b", "zero3", 512, mixed)
    computed = run_case("gpt3_175b", "zero3", 512, mixed, known_shapes=False)
    assert (computed["peak"], computed["bytes"], computed["flops"]) == (
        target["peak"],
        target["bytes"],
        target["flops"],
    )
    lines = [
        "| case | CPU seconds | wall seconds | peak RSS (GB) | vs target |",
        "| --- | --- | --- | --- | --- |",
        f"| GPT-3 175B, zero3, 512 ranks, 1 step (+ warm-up) | {target['cpu']:.1f} | {target['seconds']:.1f} | "
        f"{target['rss'] / GB:.2f} | CPU time {target['cpu'] / 60:.2f} x 60 s, RAM {target['rss'] / 4e9:.2f} x 4 GB |",
        f"| the same without known shapes (the same peak, bytes and FLOPs) | {computed['cpu']:.1f} | "
        f"{computed['seconds']:.1f} | {computed['rss'] / GB:.2f} | "
        f"known shapes take {target['cpu'] / computed['cpu']:.2f}x its CPU time |",
    ]
    if args.profile:  # where the time goes (cProfile slows the run several times: read shares, not seconds)
        split = run_case("gpt3_175b", "zero3", 512, mixed, profile=True)["split"]
        print("cProfile, cumulative seconds inside each tracker's dispatch (nested: they overlap):", split)
    if not args.quick:
        lines += [
            "",
            "| model, strategy, ranks | params | model states / rank (GB) | formula (GB) | peak (GB) "
            "| sent per step (GB) | theory (GB) | across nodes (GB) | CPU seconds |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        cases = [("zero_7_5b", s, 64, dict(mixed, seq_len=2048)) for s in ("ddp", "zero1", "zero2", "zero3")]
        cases += [("gpt3_175b", "fsdp", 512, mixed), ("gpt3_175b", "fsdp", 512, dict(mixed, sharding_group_size=8))]
        for model, strategy, world, options in cases:
            r = run_case(model, strategy, world, options)
            t = r["theory"]
            label = strategy + (" (HSDP, 8 per node)" if "sharding_group_size" in options else "")
            label += f", seq {options['seq_len']}" if "seq_len" in options else ""
            lines.append(
                f"| {model}, {label}, {world} | {r['num_params'] / 1e9:.2f}B | {r['memory'] / GB:.2f} | "
                f"{t['model_states_total'] / GB:.2f} | {r['peak'] / GB:.1f} | {r['bytes'] / GB:.1f} | "
                f"{t['bytes_per_step'] / GB:.1f} | {r['cross'] / GB:.1f} | {r['cpu']:.1f} |"
            )
    table = "\n".join(lines) + "\n\n" + NOTES
    print(table)
    if args.write:
        from benchlib import write_section

        command = "python bench/sim_speed.py" + (" --quick" if args.quick else "")
        write_section(args.write, "## The simulated cluster (bench/sim_speed.py)", command, table)


if __name__ == "__main__":
    main()
