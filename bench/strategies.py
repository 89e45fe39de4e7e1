"""The toolkit's strategies next to the implementations a user would pick instead, in one run.

Pairs: ddp vs torch DistributedDataParallel, zero1 vs ZeroRedundancyOptimizer, zero3 (also with
DeepSpeed's prefetch and reduce buckets of one block's size: "zero3-buckets") and fsdp vs FSDP2
(`fully_shard` per block, then the root). For each pair both models are built from the same seed, train
on the same batches, and their steps are interleaved (A, B, A, B, ...) so that machine noise hits
both alike. Reported: median step time per side (the slowest rank's), the ratio toolkit/peer, and
model-state bytes per rank as counted from the live tensors after a step.

    python bench/strategies.py [--world-size 2] [--steps 12] [--pairs ddp,zero1,zero3,zero3-buckets,fsdp] \
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
from toolkit.memory import ledger
from toolkit.models import SyntheticCorpus, tiny_gpt

MODEL = dict(n_layer=4, d_model=128, n_head=4, vocab_size=256, seq_len=64)
PER_RANK_BATCH = 8
LR = 1e-3


def _model():
    torch.manual_seed(0)
    return tiny_gpt(**MODEL)


def _peer(name: str):
    """The peer implementation of a toolkit strategy: (model, optimizer)."""
    model, adamw = _model(), functools.partial(torch.optim.AdamW, lr=LR)
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model), adamw(model.parameters())
    if name == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    if name in ("zero3", "fsdp"):
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model, adamw(model.parameters())
    raise ValueError(f"no peer for {name!r}")


PEERS = {
    "ddp": "torch DDP",
    "zero1": "ZeroRedundancyOptimizer",
    "zero3": "FSDP2",
    "zero3-buckets": "FSDP2",
    "fsdp": "FSDP2",
}


def _mine(name: str):
    """The toolkit's side. "zero3-buckets": ZeRO-3 with DeepSpeed's buckets set to one block's parameters,
    so that a collective moves about what one of FSDP2's units does."""
    adamw = functools.partial(torch.optim.AdamW, lr=LR)
    if name == "zero3-buckets":
        model = _model()
        block = sum(p.numel() for p in model.blocks[0].parameters())
        return parallel.wrap(model, "zero3", optimizer=adamw, prefetch_bucket_size=block, reduce_bucket_size=block)
    return parallel.wrap(_model(), name, optimizer=adamw)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _peer_memory(model, optimizer) -> int:
    tensors = [_local(p) for p in model.parameters()] + [
        _local(p.grad) for p in model.parameters() if p.grad is not None
    ]
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's state inside
    tensors += [_local(t) for s in inner.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    seen, total = set(), 0
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _step(model, optimizer, x, y) -> float:
    start = time.perf_counter()
    loss = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - start


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def bench(pairs, steps: int, warmup: int = 2):
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = SyntheticCorpus(vocab_size=MODEL["vocab_size"], seq_len=MODEL["seq_len"], seed=0)
    rows = []
    for name in pairs:
        toolkit.trace.recorder.enabled = False  # the bench measures steps, not the trace
        mine = _mine(name)
        peer = _peer("zero3" if name == "zero3-buckets" else name)
        times = {"toolkit": [], "peer": []}
        for step in range(warmup + steps):
            x, y = corpus.batch(step, PER_RANK_BATCH * world, rank=rank, world_size=world)
            for side, (model, opt) in (("toolkit", mine), ("peer", peer)):
                dist.barrier()
                seconds = _slowest(_step(model, opt, x, y))
                if step >= warmup:
                    times[side].append(seconds)
        x, y = corpus.batch(0, PER_RANK_BATCH * world, rank=rank, world_size=world)
        for model, opt in (mine, peer):  # memory right after a step's backward, before zero_grad
            model(x, y).backward()
            opt.step()
        mem_mine = ledger(*mine)
        rows.append(
            {
                "strategy": name,
                "peer": PEERS[name],
                "toolkit_s": statistics.median(times["toolkit"]),
                "peer_s": statistics.median(times["peer"]),
                "toolkit_bytes": mem_mine["params"] + mem_mine["grads"] + mem_mine["optimizer"],
                "peer_bytes": _peer_memory(*peer),
                "num_params": sum(p.numel() for p in _model().parameters()),
            }
        )
    return rows


def table(rows, world: int) -> str:
    lines = [
        f"World size {world}, gloo on CPU ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores), torch {torch.__version__}; tiny GPT {MODEL}, "
        f"{rows[0]['num_params']:,} parameters, {PER_RANK_BATCH} sequences per rank, AdamW, fp32.",
        "",
        "| strategy | peer | toolkit step (ms) | peer step (ms) | ratio toolkit/peer "
        "| toolkit model states / rank (MB) | peer model states / rank (MB) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['strategy']} | {r['peer']} | {r['toolkit_s'] * 1e3:.1f} | {r['peer_s'] * 1e3:.1f} | "
            f"{r['toolkit_s'] / r['peer_s']:.2f} | {r['toolkit_bytes'] / 1e6:.2f} | {r['peer_bytes'] / 1e6:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--pairs", default="ddp,zero1,zero3,zero3-buckets,fsdp")
    parser.add_argument("--write", help="append the table to this markdown file")
    args = parser.parse_args(argv)
    pairs = [p for p in args.pairs.split(",") if p]
    unknown = set(pairs) - set(PEERS)
    if unknown:
        parser.error(f"unknown pairs {sorted(unknown)}; choose from {sorted(PEERS)}")
    rows = toolkit.launch(bench, args.world_size, args=(pairs, args.steps), timeout_s=300, quiet=True)[0]
    text = table(rows, args.world_size)
    print(text)
    if args.write:
        benchlib.append_table(args.write, f"python {' '.join(sys.argv)}", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
