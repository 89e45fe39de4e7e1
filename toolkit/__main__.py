"""The command line: `python -m toolkit demo | compare | simulate | grade LAB | release labs/ --out DIR`.

Each subcommand lives in its own module; this file only dispatches, so `--help` stays fast. Without an
activated environment, run it with the project's interpreter: `.venv/bin/python -m toolkit ...`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, function taking the remaining argv and returning an exit code, one-line help)
COMMANDS = {
    "demo": ("toolkit.demo", "main", "run every collective through the backend and the ring; table, report, trace"),
    "grade": ("toolkit.grading", "main", "grade a lab: python -m toolkit grade labs/01-ring-allreduce"),
    "compare": ("toolkit.compare", "main", "train the tiny GPT with every strategy; table, report, traces"),
    "simulate": (
        "toolkit.sim.cli",
        "main",
        "one rank of a simulated cluster (up to 65,536 GPUs): memory, bytes, whether it fits, step time",
    ),
    "release": (
        "toolkit.grading.release",
        "main",
        "the students' copy of the labs, without solutions: release labs/ --out DIR",
    ),
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    width = max(map(len, COMMANDS))
    parser = argparse.ArgumentParser(
        prog="python -m toolkit",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n"
        + "\n".join(f"  {name:<{width}}  {text}" for name, (_, _, text) in COMMANDS.items())
        + "\n\n`python -m toolkit COMMAND --help` tells a command's options.",
    )
    parser.add_argument("command", choices=list(COMMANDS), help="one of the commands below")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    args = parser.parse_args(argv[:1])
    module, function, _ = COMMANDS[args.command]
    try:
        run = getattr(importlib.import_module(module), function)
    except (ModuleNotFoundError, AttributeError) as exc:
        print(f"`{args.command}` is not available yet ({exc}).", file=sys.stderr)
        return 2
    return int(run(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
