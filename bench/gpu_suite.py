"""The GPU path, measured: what `make test-gpu` runs wherever CUDA exists (and skips, saying so, where not).

One run prints one short markdown table per part, ready for docs/benchmarks.md (`--write` puts it there):

1. every strategy on NCCL at world = the number of GPUs (world 1 on one GPU), against "local" on the same
   device: the largest parameter difference after the steps, the median step time, and the memory ledger
   (params + grads + optimizer, from the live tensors) beside `torch.cuda.memory_allocated` after a step and
   the step's `torch.cuda.max_memory_allocated`; with one GPU, world 2 again with gloo on CUDA tensors
   (NCCL cannot give two ranks one device);
2. collective times from CUDA events (the trace recorder marks a collective's stream on NCCL): the median
   time and the algorithm bandwidth per operation and size;
3. the simulator's prediction of one step on this GPU (`toolkit.sim.simulate` with the preset of this
   accelerator) against the measured step of the same model, batch and precision, with the error;
4. the toolkit's ddp and fsdp beside torch DDP and FSDP2, steps interleaved: step-time ratios.

    python bench/gpu_suite.py [--steps 8] [--write docs/benchmarks.md]
    python bench/gpu_suite.py --cpu-dry-run      # the same code on gloo and the CPU, tiny sizes (a check of
                                                  # the suite itself, not a measurement)

Nothing here is a test assertion on time: the table is what to read; parity is the one thing checked.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import statistics
import sys
import time

import benchlib  # bench/benchlib.py (a bench runs as a script: its folder is on sys.path)
import torch

SKIP = (
    "make test-gpu: no CUDA device here (torch {torch}, torch.cuda.is_available() is False): the GPU suite "
    "was skipped. Run it on a machine with an NVIDIA GPU, with a CUDA build of torch installed into .venv "
    "first (README, 'On a GPU cluster'); `.venv/bin/python bench/gpu_suite.py --cpu-dry-run` runs the same "
    "code on the CPU."
)
STRATEGIES = ("dp", "ddp", "zero1", "zero2", "zero3", "fsdp")
# Small enough for any GPU, large enough that kernels, not launches, dominate a step.
SIZES = {
    "gpu": dict(model=dict(n_layer=4, d_model=512, n_head=8), vocab_size=1024, seq_len=256, batch=8),
    "cpu": dict(model=dict(n_layer=2, d_model=32, n_head=2), vocab_size=64, seq_len=16, batch=2),
}
# The simulator's check: one GPT-2-medium-like step in bf16 (the regime the cost model is for).
SIM_MODEL = dict(n_layer=8, d_model=1024, n_head=16, vocab_size=32768, seq_len=1024)


def _model_parallel_layouts(world: int) -> list[tuple[str, dict]]:
    """Tensor and pipeline layouts, where this toolkit has them and the world can hold them."""
    from toolkit.parallel import compose

    rows = []
    if world >= 2 and "tp" in compose.MODEL_PARALLEL:
        rows.append(("local", {"tp": world}))
    if world >= 2 and "pp" in compose.MODEL_PARALLEL and importlib.util.find_spec("toolkit.parallel.pipeline"):
        rows.append(("local", {"pp": world, "microbatches": 2 * world}))
    return rows


# --- 1. strategies -----------------------------------------------------------------------------------
def _train_rank(config):
    """One rank: train, then report the step times, the ledger after a step and CUDA's own counts."""
    import torch.distributed as dist

    from toolkit.train import train

    on_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    run, state = train(config, return_state=True)
    times = [v for _, v in run.metric("step_time")]
    sample = [s for s in run.samples if s.get("phase") == "optimizer"][-1]
    measured = {
        "ledger": sum(sample.get(k, 0) for k in ("params", "grads", "optimizer")),
        "allocated": torch.cuda.memory_allocated() if on_cuda else 0,
        "peak": torch.cuda.max_memory_allocated() if on_cuda else 0,
    }
    comm = [
        (e["name"], e["args"].get("size_bytes", 0), e["end"] - e["start"])
        for e in run.events
        if e["cat"] == "comm" and e.get("end") is not None
    ]
    return {
        "rank": dist.get_rank(),
        "times": times,
        "memory": measured,
        "comm": comm,
        "state": state if dist.get_rank() == 0 else None,
    }


def _config(strategy, options, world, size, steps, mixed):
    from toolkit.train import TrainConfig

    options = dict(options, **({"mixed_precision": True} if mixed else {}))
    return TrainConfig(
        strategy=strategy,
        steps=steps,
        global_batch_size=size["batch"] * world,
        model=size["model"],
        vocab_size=size["vocab_size"],
        seq_len=size["seq_len"],
        options=options,
        progress=False,
    )


def _max_diff(a, b) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def strategies(world, backend, size, steps, mixed):
    """Rows of part 1 and the collectives of part 2."""
    import toolkit

    launch = functools.partial(toolkit.launch, backend=backend, timeout_s=600)
    reference = launch(
        _train_rank, 1, args=(_config("local", {}, 1, dict(size, batch=size["batch"] * world), steps, mixed),)
    )[0]
    rows, comm = [], []
    for strategy, options in [(s, {}) for s in STRATEGIES] + _model_parallel_layouts(world):
        label = strategy + "".join(f" {k}={v}" for k, v in options.items() if k != "microbatches")
        try:
            ranks = launch(_train_rank, world, args=(_config(strategy, options, world, size, steps, mixed),))
        except Exception as exc:  # noqa: BLE001 - a failing strategy is a row, not the end of the suite
            rows.append(
                f"| {label} | {world} | failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]} | | | | |"
            )
            continue
        diff = _max_diff(ranks[0]["state"], reference["state"])
        step = statistics.median(t for r in ranks for t in r["times"][1:]) * 1e3
        mem = ranks[0]["memory"]
        rows.append(
            f"| {label} | {world} | {diff:.2e} | {step:.1f} | {mem['ledger'] / 2**20:.1f} | "
            f"{mem['allocated'] / 2**20:.1f} | {mem['peak'] / 2**20:.1f} |"
        )
        comm += [c for r in ranks for c in r["comm"]]
    header = (
        "| strategy | world | max abs param diff vs local | median step (ms) | ledger MiB | "
        "cuda allocated MiB | cuda peak MiB |\n|---|---|---|---|---|---|---|"
    )
    return header + "\n" + "\n".join(rows), comm


def collectives(comm) -> str:
    """Part 2: median time and algorithm bandwidth of each (operation, size) seen in part 1."""
    by = {}
    for name, size, seconds in comm:
        by.setdefault((name, size), []).append(seconds)
    lines = ["| operation | bytes | calls | median (us) | algbw (GB/s) |", "|---|---|---|---|---|"]
    largest = {}  # per operation, its four largest sizes: where bandwidth, not latency, shows
    for name, size in sorted(by, key=lambda k: (k[0], -k[1])):
        largest.setdefault(name, [])
        if len(largest[name]) < 4:
            largest[name].append((name, size))
    for name, size in (key for keys in largest.values() for key in keys):
        times = by[(name, size)]
        median = statistics.median(times)
        bw = size / median / 1e9 if median > 0 and size else 0.0
        lines.append(f"| {name} | {size} | {len(times)} | {median * 1e6:.1f} | {bw:.2f} |")
    return "\n".join(lines)


# --- 3. the simulator against this GPU ------------------------------------------------------------
def _measured_step(model_kwargs, batch, steps):
    import torch.distributed as dist  # noqa: F401 - inside launch

    from toolkit import parallel
    from toolkit.models import tiny_gpt
    from toolkit.runtime import env

    torch.manual_seed(0)
    model = tiny_gpt(**model_kwargs).to(env.device())
    model, opt = parallel.wrap(model, "ddp", mixed_precision=True)
    x = torch.randint(0, model_kwargs["vocab_size"], (batch, model_kwargs["seq_len"]), device=env.device())
    times = []
    for _ in range(steps):
        torch.cuda.synchronize() if x.is_cuda else None
        t0 = time.perf_counter()
        model.forward_backward(x, x)
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize() if x.is_cuda else None
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) if len(times) > 3 else statistics.median(times)


def simulator(backend, steps, dry_run) -> str:
    import toolkit
    from toolkit.models import tiny_gpt
    from toolkit.sim import simulate

    name = "cpu" if dry_run else torch.cuda.get_device_name()
    preset, cluster = ("this-machine", "this-machine") if dry_run else benchlib.cluster_for(name)
    if preset is None:
        return f"no simulator preset for {name!r} (presets: {sorted(benchlib.GPU_PRESETS)}): part 3 skipped."
    kwargs = dict(SIM_MODEL, n_layer=2, d_model=64, n_head=2, vocab_size=256, seq_len=64) if dry_run else SIM_MODEL
    batch = 2 if dry_run else 8
    measured = toolkit.launch(_measured_step, 1, args=(kwargs, batch, steps), backend=backend, timeout_s=600)[0]
    sim = simulate(
        functools.partial(tiny_gpt, **kwargs),
        "ddp",
        world_size=1,
        batch_per_rank=batch,
        mixed_precision=True,
        cluster=cluster,
        progress=False,
    )
    error = (sim.step_time - measured) / measured
    return (
        "| model | batch | preset | predicted step (ms) | measured step (ms) | error |\n|---|---|---|---|---|---|\n"
        f"| GPT {kwargs['n_layer']}x{kwargs['d_model']}, seq {kwargs['seq_len']} | {batch} | {preset} | "
        f"{sim.step_time * 1e3:.1f} | {measured * 1e3:.1f} | {error:+.0%} |"
    )


# --- 4. beside torch ----------------------------------------------------------------------------------
def _side_by_side(pair, size, steps):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from toolkit import parallel
    from toolkit.models import tiny_gpt
    from toolkit.runtime import env

    device = env.device()

    def build(which):
        torch.manual_seed(0)
        model = tiny_gpt(vocab_size=size["vocab_size"], seq_len=size["seq_len"], **size["model"]).to(device)
        if which == "toolkit":
            return parallel.wrap(model, pair)
        if pair == "ddp":
            model = DistributedDataParallel(model)
        else:
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
        return model, torch.optim.AdamW(model.parameters())

    sides = {"toolkit": build("toolkit"), "torch": build("torch")}
    x = torch.randint(0, size["vocab_size"], (size["batch"], size["seq_len"]), device=device)
    times = {k: [] for k in sides}
    for _ in range(steps):
        for which, (model, opt) in sides.items():  # interleaved: noise hits both alike
            torch.cuda.synchronize() if x.is_cuda else None
            t0 = time.perf_counter()
            model(x, x).backward()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize() if x.is_cuda else None
            times[which].append(time.perf_counter() - t0)
    return {k: statistics.median(v[1:]) for k, v in times.items()}


def peers(world, backend, size, steps) -> str:
    import toolkit

    lines = ["| toolkit | torch | world | toolkit step (ms) | torch step (ms) | ratio |", "|---|---|---|---|---|---|"]
    for pair, peer in (("ddp", "DDP"), ("fsdp", "FSDP2")):
        got = toolkit.launch(_side_by_side, world, args=(pair, size, steps), backend=backend, timeout_s=600)[0]
        lines.append(
            f"| {pair} | {peer} | {world} | {got['toolkit'] * 1e3:.1f} | {got['torch'] * 1e3:.1f} | "
            f"{got['toolkit'] / got['torch']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="training steps per measurement (default 8)")
    parser.add_argument("--cpu-dry-run", action="store_true", help="run the suite's code on gloo/CPU, tiny sizes")
    parser.add_argument("--write", metavar="PATH", help="put the tables into this markdown file")
    args = parser.parse_args(argv)
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print(SKIP.format(torch=torch.__version__))
        return 0
    dry = args.cpu_dry_run
    world = 2 if dry else torch.cuda.device_count()
    backend = "gloo" if dry else "nccl"
    size = SIZES["cpu" if dry else "gpu"]
    where = (
        "CPU dry run (gloo), not a measurement"
        if dry
        else (f"{torch.cuda.get_device_name()} x{world}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    )
    parts = [f"Device: {where}."]
    table, comm = strategies(world, backend, size, args.steps, mixed=not dry)
    parts += ["Strategies (bf16 mixed precision on the GPU):", table]
    if not dry and world == 1:  # two ranks on one GPU: gloo moves the CUDA tensors
        os.environ["TOOLKIT_DEVICE"] = "cuda"
        table2, comm2 = strategies(2, "gloo", size, args.steps, mixed=True)
        os.environ.pop("TOOLKIT_DEVICE")
        parts += ["World 2 on one GPU, gloo on CUDA tensors (collective times are host times here):", table2]
    parts += ["Collectives (CUDA events on NCCL):" if not dry else "Collectives (host times):", collectives(comm)]
    parts += ["The simulator against this device:", simulator(backend, args.steps, dry)]
    parts += ["Beside torch:", peers(world, backend, size, args.steps)]
    text = "\n\n".join(parts)
    print(text)
    if args.write and not dry:
        benchlib.write_section(args.write, "## The GPU suite", "python bench/gpu_suite.py", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
