"""`make test-stress`: the multi-process tests, run while other processes burn every CPU core, N rounds in a row.

A shared course machine or a CI runner is rarely quiet: ranks are descheduled mid-collective, a peer's
message arrives late, a background thread finishes in another order. A test that passes only on a quiet
machine fails there by chance, and a suite that fails by chance teaches everyone to ignore red. This
script makes the machine busy on purpose (burner processes spinning at the tests' own priority, by
default two per core: a load average of 2x the cores before the tests add their own) and runs the tests
that start ranks, `--rounds` times; it stops at the first red round and says so.

    python tests/stress.py [--rounds 3] [--burners-per-core 2] [--all] [pytest args...]

Not part of `make test` (it takes several times the suite's time by design). Exit status: 0 when every
round passed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# A test file that starts ranks (or engines, or a simulated cluster beside a real one) names one of these.
STARTS_RANKS = re.compile(
    r"\b(launch|launch_train|compare|cluster|run_lab|grade|mpiexec|torchrun|subprocess\.\w+)\s*\(|lab_grading|nbclient"
)


def _burn() -> None:
    while True:
        pass


def multi_process_files() -> list[str]:
    """The test files that start processes: the ones whose outcome scheduling can change."""
    found = []
    for name in sorted(os.listdir(HERE)):
        if name.startswith("test_") and name.endswith(".py"):
            with open(os.path.join(HERE, name)) as f:
                if STARTS_RANKS.search(f.read()):
                    found.append(os.path.join("tests", name))
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds in a row that must pass (default 3)")
    parser.add_argument("--burners-per-core", type=float, default=2.0, help="busy processes per core (default 2)")
    parser.add_argument("--all", action="store_true", help="the whole suite, not only the multi-process tests")
    args, pytest_args = parser.parse_known_args(argv)
    cores = os.cpu_count() or 1
    burners = [
        multiprocessing.Process(target=_burn, daemon=True) for _ in range(max(1, round(args.burners_per_core * cores)))
    ]
    files = [] if args.all else multi_process_files()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files, *pytest_args]
    print(
        f"stress: {len(burners)} burners on {cores} cores; {len(files) or 'all'} test files; {args.rounds} rounds",
        flush=True,
    )
    for p in burners:
        p.start()
    try:
        for round_ in range(1, args.rounds + 1):
            start, load = time.time(), os.getloadavg()[0]
            code = subprocess.call(command, cwd=ROOT)
            print(
                f"stress: round {round_}/{args.rounds}: {'green' if code == 0 else f'RED (pytest exit {code})'} "
                f"in {time.time() - start:.0f} s, load average {load:.1f} at its start, "
                f"{os.getloadavg()[0]:.1f} at its end",
                flush=True,
            )
            if code != 0:
                return code
    finally:
        for p in burners:
            p.terminate()
        for p in burners:
            p.join(5)
    print(f"stress: {args.rounds} rounds green in a row")
    return 0


if __name__ == "__main__":
    sys.exit(main())
