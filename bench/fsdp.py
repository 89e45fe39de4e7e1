"""The toolkit's FSDP next to PyTorch's FSDP2 (`fully_shard`), per prefetch setting, in one run.

Both wrap the same model the same way (one unit per block, then the root), start from the same seed,
train the same batches, and their steps are interleaved (A, B, A, B, ...) so machine noise hits both
alike. Configurations (toolkit options / what FSDP2 is told):

    default       backward prefetch                 / FSDP2's implicit backward prefetch
    no-prefetch   backward_prefetch=False           / set_modules_to_backward_prefetch([]) on every unit
    prefetch      forward_prefetch=True (+ backward) / each block set_modules_to_forward_prefetch(next block)
    hsdp          sharding_group_size=2             / fully_shard on a (N/2 replicas, 2 shards) mesh (N >= 4)

Reported per configuration: median step time per side (the slowest rank's), the ratio toolkit/FSDP2,
peak bytes per rank over one step measured by torch's MemTracker (every allocation: model states,
gathered units, activations, temporaries), and the largest loss difference (the two must agree).

    python bench/fsdp.py [--world-size 2] [--steps 10] [--configs default,no-prefetch,prefetch,hsdp] \
        [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import sys
import time

import benchlib  # bench/benchlib.py (a bench runs as a script: its folder is on sys.path)
import torch
import torch.distributed as dist

import toolkit
from toolkit import parallel
from toolkit.models import SyntheticCorpus, tiny_gpt
from toolkit.runtime import env

MODEL = dict(n_layer=4, d_model=128, n_head=4, vocab_size=256, seq_len=64)
PER_RANK_BATCH = 8
LR = 1e-3
CONFIGS = {
    "default": {},
    "no-prefetch": {"backward_prefetch": False},
    "prefetch": {"forward_prefetch": True},
    "hsdp": {"sharding_group_size": 2},
}


def _model():
    torch.manual_seed(0)
    return tiny_gpt(**MODEL)


def _fsdp2(name: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, world = _model().to(env.device()), dist.get_world_size()
    if name == "hsdp":  # rows replicate, columns shard: shard groups of 2 consecutive ranks, as ours
        mesh = init_device_mesh(env.device().type, (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(env.device().type, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if name == "no-prefetch":
        for module in [*model.blocks, model]:
            module.set_modules_to_backward_prefetch([])
    if name == "prefetch":
        for block, following in zip(model.blocks[:-1], model.blocks[1:]):
            block.set_modules_to_forward_prefetch([following])
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def _step(model, optimizer, x, y) -> tuple[float, float]:
    start = time.perf_counter()
    loss = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if env.device().type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, loss.item()


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=env.device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # bookkeeping: not through the door, not in any trace
    return t.item()


def _peak(model, optimizer, x, y) -> int:
    """Peak bytes on this rank over one step, everything allocated (MemTracker), states already there."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        _step(model, optimizer, x, y)
    return tracker.get_tracker_snapshot("peak")[env.device()]["Total"]


def bench(names, steps: int, warmup: int = 2):
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = SyntheticCorpus(vocab_size=MODEL["vocab_size"], seq_len=MODEL["seq_len"], seed=0)
    toolkit.trace.recorder.enabled = False  # the bench measures steps, not the trace
    rows = []
    for name in names:
        adamw = functools.partial(torch.optim.AdamW, lr=LR)
        sides = {"toolkit": parallel.wrap(_model(), "fsdp", optimizer=adamw, **CONFIGS[name]), "fsdp2": _fsdp2(name)}
        times, losses = {s: [] for s in sides}, {s: [] for s in sides}
        for step in range(warmup + steps):
            x, y = corpus.batch(step, PER_RANK_BATCH * world, rank=rank, world_size=world, device=env.device())
            for side, (model, opt) in sides.items():
                dist.barrier()
                seconds, loss = _step(model, opt, x, y)
                losses[side].append(loss)
                if step >= warmup:
                    times[side].append(_slowest(seconds))
        x, y = corpus.batch(0, PER_RANK_BATCH * world, rank=rank, world_size=world, device=env.device())
        peaks = {side: _peak(model, opt, x, y) for side, (model, opt) in sides.items()}
        rows.append(
            {
                "config": name,
                "toolkit_s": statistics.median(times["toolkit"]),
                "fsdp2_s": statistics.median(times["fsdp2"]),
                "toolkit_peak": peaks["toolkit"],
                "fsdp2_peak": peaks["fsdp2"],
                "loss_diff": max(abs(a - b) for a, b in zip(losses["toolkit"], losses["fsdp2"])),
                "num_params": _model().num_params(),
            }
        )
    return rows


def table(rows, world: int) -> str:
    lines = [
        f"FSDP vs FSDP2, world size {world}, {'NCCL on GPU' if torch.cuda.is_available() else 'gloo on CPU'} "
        f"({platform.processor() or platform.machine()}, {os.cpu_count()} cores), torch {torch.__version__}; "
        f"tiny GPT {MODEL}, {rows[0]['num_params']:,} parameters, {PER_RANK_BATCH} sequences per rank, AdamW, "
        f"fp32; units: each block, then the root.",
        "",
        "| config | toolkit step (ms) | FSDP2 step (ms) | ratio toolkit/FSDP2 | toolkit peak / rank (MB) | "
        "FSDP2 peak / rank (MB) | max loss difference |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['toolkit_s'] * 1e3:.1f} | {r['fsdp2_s'] * 1e3:.1f} | "
            f"{r['toolkit_s'] / r['fsdp2_s']:.2f} | {r['toolkit_peak'] / 1e6:.2f} | "
            f"{r['fsdp2_peak'] / 1e6:.2f} | {r['loss_diff']:.1e} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--configs",
        default=None,
        help=f"comma-separated, from {list(CONFIGS)} (default: all; hsdp needs a world size of 4 or more)",
    )
    parser.add_argument("--write", help="append the table to this markdown file")
    args = parser.parse_args(argv)
    names = [c for c in (args.configs or ",".join(CONFIGS)).split(",") if c]
    if args.configs is None and args.world_size < 4:
        names.remove("hsdp")
    unknown = set(names) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}; choose from {list(CONFIGS)}")
    if "hsdp" in names and (args.world_size < 4 or args.world_size % 2):
        parser.error("hsdp shards over pairs of ranks and replicates across pairs: use an even --world-size >= 4")
    rows = toolkit.launch(bench, args.world_size, args=(names, args.steps), timeout_s=600, quiet=True)[0]
    text = table(rows, args.world_size)
    print(text)
    if args.write:
        benchlib.append_table(args.write, f"python {' '.join(sys.argv)}", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
