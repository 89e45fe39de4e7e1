"""What starting ranks costs: a launch that does nothing, as fresh interpreters (TOOLKIT_LAUNCH_EXEC=1) and as
ranks forked by the zygote (toolkit/runtime/zygote.py), side by side.

Each measurement is a process of its own that imports toolkit and runs `k` launches of a function that
returns at once. Its CPU time is the kernel's (wait4): its own, and that of every process below it as each
was reaped (keeper, ranks, zygote: the launcher collects its zygote at exit). Three such processes per
mode and world size, run in turns, give what a launch costs:

    first launch = cpu(k=1) - cpu(k=0)        (a zygote's start-up included)
    next launches = (cpu(k=1+n) - cpu(k=1)) / n

and the wall time of each launch, timed inside. On a shared machine CPU time is the measure; wall time
says how busy the neighbours were.

    .venv/bin/python bench/launch.py [--worlds 2 4] [--next 4] [--repeats 3] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODES = {"fresh": {"TOOLKIT_LAUNCH_EXEC": "1"}, "zygote": {}}


def _child(world_size: int, launches: int) -> None:
    """In the measured process: `launches` launches of a function that does nothing; their wall times."""
    import toolkit

    walls = []
    for _ in range(launches):
        start = time.perf_counter()
        toolkit.launch(int, world_size, quiet=True)
        walls.append(time.perf_counter() - start)
    print(json.dumps(walls))


def _measure(mode: str, world_size: int, launches: int) -> tuple[float, list[float]]:
    """(CPU seconds of the process and all it started, wall seconds of each launch)."""
    env = dict(os.environ, **MODES[mode])
    if mode != "fresh":
        env.pop("TOOLKIT_LAUNCH_EXEC", None)
    with tempfile.TemporaryFile() as err:  # its stderr, said if it fails (a file: wait4 must reap it, not a reader)
        proc = subprocess.Popen(
            [sys.executable, __file__, "--child", str(world_size), str(launches)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            cwd=ROOT,
        )
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            why = err.read().decode(errors="replace").strip()[-4000:] or "(it printed nothing on stderr)"
            raise RuntimeError(
                f"{mode} at world {world_size} with {launches} launches ended with {proc.returncode}:\n{why}"
            )
    return usage.ru_utime + usage.ru_stime, json.loads(out)


def bench(worlds, next_launches: int, repeats: int) -> dict:
    """{(mode, world): {"first_cpu", "next_cpu", "first_wall", "next_wall": [one per repeat]}}."""
    rows = {(m, w): {"first_cpu": [], "next_cpu": [], "first_wall": [], "next_wall": []} for w in worlds for m in MODES}
    for repeat in range(repeats):
        for w in worlds:
            order = list(MODES) if repeat % 2 == 0 else list(MODES)[::-1]  # neither side always goes first
            for mode in order:
                none, _ = _measure(mode, w, 0)
                one, walls_one = _measure(mode, w, 1)
                many, walls = _measure(mode, w, 1 + next_launches)
                row = rows[(mode, w)]
                row["first_cpu"].append(one - none)
                row["next_cpu"].append((many - one) / next_launches)
                row["first_wall"].append(statistics.mean([walls_one[0], walls[0]]))
                row["next_wall"].append(statistics.median(walls[1:]))
                print(
                    f"repeat {repeat} {mode:>6} world {w}: first {one - none:.2f} CPU s, next "
                    f"{row['next_cpu'][-1]:.2f} CPU s / {row['next_wall'][-1]:.2f} s wall",
                    file=sys.stderr,
                )
    return rows


def table(rows: dict, worlds) -> str:
    def cell(values):
        return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

    lines = [
        "| world | ranks start as | first launch: CPU s | its wall s | next launches: CPU s each | wall s each "
        "| next: CPU ratio zygote / fresh |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for w in worlds:
        for mode in MODES:
            r = rows[(mode, w)]
            ratio = statistics.median(r["next_cpu"]) / statistics.median(rows[("fresh", w)]["next_cpu"])
            lines.append(
                f"| {w} | {mode} | {cell(r['first_cpu'])} | {cell(r['first_wall'])} | {cell(r['next_cpu'])} "
                f"| {cell(r['next_wall'])} | {ratio:.2f} |"
            )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--next", type=int, default=4, help="launches after the first, per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", help="put the table into this markdown file (docs/benchmarks.md)")
    parser.add_argument("--child", type=int, nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(*args.child)
        return
    load = os.getloadavg()[0]
    text = table(bench(args.worlds, args.next, args.repeats), args.worlds)
    text += (
        f"\n\nMedian (min-max) over {args.repeats} repeats; load average {load:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} cores."
    )
    print(text)
    if args.write:
        sys.path.insert(0, HERE)
        from benchlib import write_section

        write_section(
            args.write,
            "## Starting ranks: fresh interpreters against the zygote (bench/launch.py)",
            "python bench/launch.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            text,
        )


if __name__ == "__main__":
    main()
