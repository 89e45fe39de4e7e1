"""What recording costs: the collectives door against torch.distributed called directly.

Both loops run in the same launch, interleaved in rounds, on the same tensors, so machine noise hits
both alike. Small messages make the fixed per-call cost visible; a large one shows it vanish.

    python bench/door_overhead.py [--world-size 2] [--calls 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import toolkit
from toolkit import comm


def _measure(numel: int, calls: int, rounds: int):
    x = torch.ones(numel)
    direct, door = [], []
    for _ in range(rounds):
        for loop, out in ((lambda: dist.all_reduce(x), direct), (lambda: comm.all_reduce(x), door)):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                loop()
            out.append((time.perf_counter() - start) / calls)
        toolkit.trace.recorder.reset()  # keep the recorder's list from growing without bound
    return statistics.median(direct), statistics.median(door)


def bench(sizes, calls, rounds):
    return {numel: _measure(numel, calls if numel < 100_000 else max(calls // 20, 20), rounds) for numel in sizes}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    sizes = [1, 1024, 1 << 20]
    result = toolkit.launch(bench, args.world_size, args=(sizes, args.calls, args.rounds), quiet=True)[0]
    print(f"all_reduce, world size {args.world_size}, gloo on {torch.get_num_threads()}-thread CPU ranks")
    print(f"{'elements':>10} {'direct us':>10} {'door us':>10} {'ratio':>7} {'extra us':>9}")
    for numel, (direct, door) in result.items():
        print(
            f"{numel:>10} {direct * 1e6:>10.1f} {door * 1e6:>10.1f} {door / direct:>7.3f} {(door - direct) * 1e6:>9.1f}"
        )


if __name__ == "__main__":
    main()
