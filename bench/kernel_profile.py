"""Where one training step's time goes on this GPU, kernel by kernel, beside what the simulator prices for each part.

Issue 30's open question: the published H100 runs took 28-39% longer than the simulator prices their steps from the
H100's benchmarks (GEMM sweeps, FlashAttention-2's figures, STREAM-like bandwidth), and their A100 twins 8-15%
(docs/differences.md, "The H100 gap"). Only a profile of a real step says which kernels ran slower than their price,
and whether the GPU held its clock. This runs one: MPT-7B's layer (d 4096, 32 heads, sequences of 2,048, its 50,368-
word vocabulary), a few layers of it on one GPU, bf16 mixed precision ("local": one process), `torch.profiler`
over the timed steps, every CUDA kernel put in one of the simulator's categories by its name; beside it the same
model and batch simulated on this GPU's preset. The SM clock and the power draw are sampled from `nvidia-smi`
while the steps run.

    .venv/bin/python bench/kernel_profile.py [--layers 4] [--batch 4] [--steps 6]   # `make test-gpu` runs it
    .venv/bin/python bench/kernel_profile.py --cpu-dry-run   # the same code on the CPU, tiny sizes: a check of
                                                             # the script, not a measurement

Read the ratio column: a category measured at 1.3x its price ran that much slower than the benchmarks say its
kernels can; GPU idle time (the step less its kernels) is what no kernel's price covers. No test asserts a time.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import subprocess
import sys
import threading
import time

import benchlib  # bench/benchlib.py (a bench runs as a script: its folder is on sys.path)
import torch

MPT_7B = dict(d_model=4096, n_head=32, vocab_size=50368, seq_len=2048)
TINY = dict(d_model=32, n_head=2, vocab_size=64, seq_len=16)
SKIP = (
    "bench/kernel_profile.py: no CUDA device here (torch.cuda.is_available() is False): the kernel profile was "
    "skipped; `.venv/bin/python bench/kernel_profile.py --cpu-dry-run` runs the same code on the CPU."
)
# the simulator's categories (`StepCost.breakdown`), and how a kernel's or a CPU operator's name says which it is
CATEGORIES = ("gemm", "attention", "memory_bound", "optimizer")
_NAMES = {  # in this order: an attention kernel may be built on CUTLASS too (fmha_cutlassF_...)
    "attention": ("flash", "fmha", "attention", "sdpa"),
    "optimizer": ("multi_tensor", "adam", "foreach"),
    "gemm": ("gemm", "cutlass", "xmma", "nvjet", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"),
}


def category(name: str) -> str:
    """The simulator's category a kernel (or, on the CPU, an aten operator) belongs to, by its name."""
    low = name.lower()
    for what, marks in _NAMES.items():
        if any(mark in low for mark in marks):
            return what
    return "memory_bound"


def _model(layers: int, shape: dict):
    from toolkit.models import tiny_gpt

    return tiny_gpt(n_layer=layers, **shape)


class _Clocks:
    """The SM clock, its maximum, the power draw and its limit, sampled from nvidia-smi every half second."""

    QUERY = "clocks.sm,clocks.max.sm,power.draw,power.limit"

    def __init__(self):
        self.samples, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                out = subprocess.run(
                    ["nvidia-smi", "-i", "0", f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=5,
                ).stdout
                self.samples.append([float(v) for v in out.strip().split(",")])
            except (OSError, ValueError, subprocess.TimeoutExpired):
                return  # no nvidia-smi, or a field it cannot read: no clock line
            self._stop.wait(0.5)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=10)

    def line(self) -> str:
        if not self.samples:
            return "SM clock and power: not available (no nvidia-smi reading)."
        clock, top, power, limit = (statistics.median(s[i] for s in self.samples) for i in range(4))
        return (
            f"SM clock while the steps ran: median {clock:.0f} MHz of a {top:.0f} MHz maximum ({clock / top:.0%}); "
            f"power: median {power:.0f} W of a {limit:.0f} W limit ({len(self.samples)} samples)."
        )


def measure(layers: int, batch: int, steps: int, shape: dict, cuda: bool) -> dict:
    """{category: ms a step} of the kernels (CUDA) or operators' own time (CPU) over `steps` profiled steps, and the
    median wall time of a step."""
    from torch.profiler import ProfilerActivity, profile

    from toolkit import parallel

    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    model, opt = parallel.wrap(_model(layers, shape).to(device), "local", mixed_precision=True)
    x = torch.randint(0, shape["vocab_size"], (batch, shape["seq_len"]), device=device)

    def step():
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()

    for _ in range(2):  # warm-up: allocator, kernels chosen, optimizer states made
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    walls = []
    with profile(activities=activities) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            walls.append(time.perf_counter() - t0)
    kernels = dict.fromkeys(CATEGORIES, 0.0)
    for event in prof.key_averages():
        on_device = event.device_type == torch.autograd.DeviceType.CUDA
        if cuda and on_device:
            kernels[category(event.key)] += event.self_device_time_total / 1e3 / steps
        elif not cuda and event.key.startswith("aten::"):
            kernels[category(event.key)] += event.self_cpu_time_total / 1e3 / steps
    return {"kernels": kernels, "step_ms": statistics.median(walls) * 1e3}


def priced(layers: int, batch: int, shape: dict, cluster) -> dict:
    """The simulator's breakdown of the same step, ms."""
    from toolkit.sim import simulate

    sim = simulate(
        functools.partial(_model, layers, shape),
        "local",
        1,
        batch_per_rank=batch,
        mixed_precision=True,
        cluster=cluster,
        progress=False,
    )
    return {k: v * 1e3 for k, v in sim.breakdown.items()}


def table(measured: dict, price: dict) -> str:
    rows = ["| category | measured (ms a step) | priced (ms) | measured / priced |", "| --- | --- | --- | --- |"]
    for what in CATEGORIES:
        got, want = measured["kernels"][what], price.get(what, 0.0)
        ratio = f"{got / want:.2f}" if want > 0 else "-"
        rows.append(f"| {what.replace('_', '-')} | {got:.2f} | {want:.2f} | {ratio} |")
    busy = sum(measured["kernels"].values())
    rows.append(f"| all kernels | {busy:.2f} | {sum(price.get(w, 0.0) for w in CATEGORIES):.2f} | - |")
    wall, step = measured["step_ms"], price["step"]
    rows.append(f"| the step (wall) | {wall:.2f} | {step:.2f} | {wall / step:.2f} |")
    idle = measured["step_ms"] - busy
    return "\n".join(rows) + f"\n\nNo kernel running for {idle:.2f} ms of the step ({idle / measured['step_ms']:.0%})."


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="MPT-7B layers on the GPU (default 4)")
    parser.add_argument("--batch", type=int, default=4, help="sequences of 2,048 a step (default 4)")
    parser.add_argument("--steps", type=int, default=6, help="profiled steps (default 6)")
    parser.add_argument("--cpu-dry-run", action="store_true", help="the same code on the CPU, tiny sizes")
    args = parser.parse_args(argv)
    dry = args.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        print(SKIP)
        return 0
    name = "cpu" if dry else torch.cuda.get_device_name()
    preset, cluster = ("dgx-a100", "dgx-a100") if dry else benchlib.cluster_for(name)
    if preset is None:
        presets = sorted(benchlib.GPU_PRESETS)
        print(f"bench/kernel_profile.py: no simulator preset for {name!r} (presets: {presets}): skipped.")
        return 0
    shape, layers, batch = (TINY, 2, 2) if dry else (MPT_7B, args.layers, args.batch)
    clocks = _Clocks() if not dry else contextlib.nullcontext()
    with clocks:
        measured = measure(layers, batch, args.steps, shape, cuda=not dry)
    where = "CPU dry run: the CPU's operators against dgx-a100's prices, not a measurement" if dry else name
    print(
        f"One step of MPT-7B's layer x{layers} ({shape}), batch {batch}, bf16, on {where}; priced on {preset} "
        f"(`toolkit.sim`), kernels by `torch.profiler` over {args.steps} steps:\n"
    )
    print(table(measured, priced(layers, batch, shape, cluster)))
    print("\n" + (clocks.line() if not dry else "SM clock and power: not read in a dry run."))
    return 0


if __name__ == "__main__":
    sys.exit(main())
