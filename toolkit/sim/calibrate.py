"""The "this-machine" preset: this computer's rates, measured once with every rank busy, cached on disk.

A prediction is only as good as its constants. For the GPU presets they come from datasheets and
published measurements (Megatron-LM's achieved fraction of peak on a real training step); for this
computer they are measured the same way, by the same ranks a real run would use (N processes sharing
its cores, all at once, so each rank measures its share of the machine):

- FLOP/s of a matrix product (fp32 and bf16): the peak;
- the cost of one operation beyond its work: a tiny training step timed and divided by the aten
  operations it dispatches;
- memory bandwidth (a copy between two preallocated buffers);
- the achievable fraction of peak (`mfu`), as the GPU presets have it: one training step of a small
  reference GPT (`REFERENCE`, no communication: "local"), timed on every rank at once; the simulator
  records that step's program and the fraction is solved so that the cost model reproduces the
  measured time. One constant per machine, from a model that is not the one being predicted;
- the loopback links, as a step pays them: each collective is called through the collectives door
  at several sizes with compute between the calls (a spread of gaps, as a step has), with no barrier
  before each; what the calls add to the loop's time, divided by the calls, is the mean cost of one
  (the door's host work, the handover to gloo's thread and back, the ranks' skew and the slow tail are
  all in it: a step pays every call's tail, so the mean, not the median of back-to-back calls).
  `toolkit.viz.fit_alpha_beta` fits alpha and beta to each operation apart (gloo runs a
  reduce-scatter as an all-reduce, so one fit for all would mislead);
- how much of a collective hides behind compute (`Cluster.overlap`): the same loop with the
  all-gather issued asynchronously before the compute and waited after it; the time it saves over
  the synchronous loop, over the time it could save (the shorter of the two). On a GPU the links and
  the streams are separate hardware (1.0); here gloo's threads copy on the cores the ranks compute on.

The result is cached as JSON under the cache folder (``$TOOLKIT_CACHE_DIR``, else
``$XDG_CACHE_HOME/toolkit``, else ``~/.cache/toolkit``), keyed by host, torch version, core count and
world size; `this_machine(world_size, refresh=True)` measures again.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

from ..comm.emulate import Link, Settings
from ..comm.measure import _numel_for, _prepare
from .hardware import Accelerator, Cluster

VERSION = 3
REFERENCE = dict(model=dict(n_layer=2, d_model=128, n_head=4, vocab_size=256, seq_len=64), batch=8)
OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")
SIZES = (4 * 1024, 64 * 1024, 512 * 1024, 2 * 1024 * 1024)
GAPS = (3, 10, 30)       # 128x128 matmuls between two calls, in turn (about 0.1, 0.3 and 1 ms on 2 cores)
CALLS, ROUNDS = 18, 3    # calls per timed loop; loops with and without the calls, interleaved
OVERLAP_SIZES, OVERLAP_GAPS = (512 * 1024, 2 * 1024 * 1024), (50,)  # compute about as long as the call
OVERLAP_ROUNDS = 5       # a difference of two noisy loops: on 2 cores it still spreads 0-0.5 between calibrations


def cache_dir() -> Path:
    base = os.environ.get("TOOLKIT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "toolkit")
    return Path(base) / "sim"


def _key(world_size: int) -> dict:
    import torch

    return {"version": VERSION, "host": platform.node(), "torch": torch.__version__,
            "cores": os.cpu_count(), "world_size": world_size, "reference": REFERENCE}


# --- on every rank ---------------------------------------------------------------------------------------
def _median_time(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _count_ops(fn) -> int:
    """How many aten operations `fn` dispatches (what a program's `Compute.ops` counts)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.calls += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        fn()
    return Counter.calls


def _tiny_step():
    """A training step whose arithmetic is negligible: what remains is the cost of dispatching its ops."""
    import torch

    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8))
                                  for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    return step


def reference_step(reference=REFERENCE):
    """One local training step of the reference GPT (no communication): what the achievable rate is fitted to."""
    import torch

    from toolkit.models import SyntheticCorpus, tiny_gpt

    torch.manual_seed(0)
    model = tiny_gpt(**reference["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = SyntheticCorpus(reference["model"]["vocab_size"], reference["model"]["seq_len"], 0).batch(0, reference["batch"])

    def step():
        model(x, y).backward()
        opt.step()
        opt.zero_grad()

    return step


def _measure_on_rank(ops, sizes, reference) -> dict:
    import torch
    import torch.distributed as dist

    from toolkit.trace.events import recorder

    def together(fn, repeats, block=1):
        """Seconds of one fn() with every rank at it; timed `block` calls at a time, so that each timing spans
        several of the scheduler's slices and a rank sees its share of the cores (ranks > cores), not a
        lucky or unlucky slice of it."""
        dist.barrier()
        return _median_time(lambda: [fn() for _ in range(block)], repeats) / block

    step = _tiny_step()
    step()
    op_count = _count_ops(step)
    overhead = together(step, 15) / op_count
    rates = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(512, 256, dtype=dtype), torch.randn(256, 512, dtype=dtype)
        seconds = together(lambda: a @ b, 10, block=8)
        rates[name] = 2 * 512 * 256 * 512 / max(seconds - overhead, seconds / 10)
    src, dst = torch.randn(2 * 2 ** 20), torch.empty(2 * 2 ** 20)  # 8 MiB each, allocated once
    bandwidth = 2 * src.numel() * 4 / together(lambda: dst.copy_(src), 10, block=8)
    reference_s = together(reference_step(reference), 7)
    recorder.enabled = False  # bookkeeping: the calibration leaves no trace
    records, n = [], dist.get_world_size()
    for op in ops:
        for size in sizes:
            numel = _numel_for(size, n, 4)
            seconds = _in_a_step(_prepare(op, numel, torch.float32, torch.device("cpu"), seed=len(records)))
            records.append(dict(op=op, impl="backend", size_bytes=numel * 4, world_size=n, seconds=seconds))
    return {"flops": rates, "op_overhead": overhead, "ops_in_tiny_step": op_count,
            "memory_bandwidth": bandwidth, "reference_step_s": reference_s, "records": records,
            "overlap": _overlap(sizes=OVERLAP_SIZES)}


def _loop(call, reset=lambda: None, gaps=GAPS) -> float:
    """Seconds for CALLS rounds of (compute, then `call`), all ranks starting together."""
    import torch
    import torch.distributed as dist

    a, b = torch.randn(128, 128), torch.randn(128, 128)
    dist.barrier()
    start = time.perf_counter()
    for i in range(CALLS):
        reset()
        for _ in range(gaps[i % len(gaps)]):
            a @ b
        call()
    return time.perf_counter() - start


def _in_a_step(prepared) -> float:
    """The mean seconds one call adds to a loop that computes between calls (every rank: the slowest one's)."""
    import torch
    import torch.distributed as dist

    reset, call, _ = prepared
    _loop(call, reset)  # warm-up
    with_calls, without = [], []
    for _ in range(ROUNDS):
        with_calls.append(_loop(call, reset))
        without.append(_loop(lambda: None, reset))
    added = torch.tensor([max(statistics.median(with_calls) - statistics.median(without), 0.0) / CALLS])
    dist.all_reduce(added, op=dist.ReduceOp.MAX)
    return added.item()


def _overlap(sizes) -> float:
    """The fraction of an asynchronous all-gather that hides behind the compute issued after it, pooled over
    `sizes`: (synchronous loop - asynchronous loop) / the shorter of (its calls, its compute), in [0, 1]."""
    import torch
    import torch.distributed as dist

    from ..comm import collectives as door

    saved = possible = 0.0
    for size in sizes:
        n = dist.get_world_size()
        out = torch.empty(_numel_for(size, n, 4))
        mine = out[: out.numel() // n].clone()
        pending = []

        def issue():  # runs before the compute of the next round: waited there, after it
            if pending:
                pending.pop().wait()
            pending.append(door.all_gather(out, mine, async_op=True))

        def synchronous():
            door.all_gather(out, mine)

        _loop(synchronous, gaps=OVERLAP_GAPS)
        times = {"sync": [], "async": [], "none": []}
        for _ in range(OVERLAP_ROUNDS):
            times["sync"].append(_loop(synchronous, gaps=OVERLAP_GAPS))
            times["async"].append(_loop(lambda: None, issue, OVERLAP_GAPS) + _drain(pending))
            times["none"].append(_loop(lambda: None, gaps=OVERLAP_GAPS))
        sync, overlapped, compute = (statistics.median(times[k]) for k in ("sync", "async", "none"))
        saved += sync - overlapped
        possible += min(sync - compute, compute)
    both = torch.tensor([saved, possible])
    dist.all_reduce(both)
    return min(max(both[0].item() / both[1].item(), 0.0), 1.0) if both[1] > 0 else 1.0


def _drain(pending) -> float:
    start = time.perf_counter()
    while pending:
        pending.pop().wait()
    return time.perf_counter() - start


def fit_mfu(m: dict) -> float:
    """The fraction of the matmul peak at which the cost model reproduces the measured reference step."""
    import functools

    from ..models import tiny_gpt
    from .cost import compute_time
    from .simulate import simulate

    sim = simulate(functools.partial(tiny_gpt, **REFERENCE["model"]), "local", 1, batch_per_rank=REFERENCE["batch"],
                   progress=False)
    segments = [c for c in sim.programs[-1] if hasattr(c, "flops")]
    gpu = Accelerator("reference", {"fp32": m["flops"]["fp32"]}, 0, m["memory_bandwidth"], 1.0, m["op_overhead"])

    def predicted(mfu):
        return sum(compute_time(c, gpu, "fp32", mfu) for c in segments)

    if predicted(1.0) >= m["reference_step_s"]:
        return 1.0  # already as slow as measured at the full matmul rate
    low, high = 1e-4, 1.0
    for _ in range(60):  # predicted() falls as mfu rises: bisect
        mid = (low + high) / 2
        low, high = (mid, high) if predicted(mid) > m["reference_step_s"] else (low, mid)
    return (low + high) / 2


# --- in the caller ------------------------------------------------------------------------------------------
def measure(world_size: int, *, timeout_s: float = 180.0) -> dict:
    """Launch `world_size` ranks and measure; compute rates are the slowest rank's."""
    from ..runtime import launch
    from ..viz.bandwidth import fit_alpha_beta

    results = launch(_measure_on_rank, world_size, args=(OPS, SIZES, REFERENCE), timeout_s=timeout_s)
    links = {}
    for op in OPS:
        alpha, beta = fit_alpha_beta([r for r in results[0]["records"] if r["op"] == op], impl=None)
        links[op] = {"bandwidth": 1 / beta if beta > 0 else 1e15, "latency": max(alpha, 1e-9)}
    m = dict(_key(world_size), measured_at=time.strftime("%Y-%m-%d %H:%M"),
             flops={k: min(r["flops"][k] for r in results) for k in ("fp32", "bf16")},
             op_overhead=max(r["op_overhead"] for r in results),
             memory_bandwidth=min(r["memory_bandwidth"] for r in results),
             reference_step_s=max(r["reference_step_s"] for r in results),
             links=links, overlap=results[0]["overlap"], records=results[0]["records"])
    m["mfu"] = fit_mfu(m)
    return m


def from_measurements(m: dict, link: Settings | None = None, *, reference_step_s: float | None = None) -> Cluster:
    """The Cluster a measurement describes; `link` (an emulated interconnect) replaces the loopback.

    reference_step_s: the reference step timed again (a benchmark times it beside what it predicts, so
    that the machine's load is the same for both); the achievable fraction is fitted to it anew.
    """
    if reference_step_s is not None:
        m = dict(m, reference_step_s=reference_step_s)
        m["mfu"] = fit_mfu(m)
    n = m["world_size"]
    gpu = Accelerator(f"this machine ({n} ranks on {m['cores']} cores)",
                      {"fp32": m["flops"]["fp32"], "bf16": m["flops"]["bf16"], "fp16": m["flops"]["bf16"]},
                      memory_bytes=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
                      memory_bandwidth=m["memory_bandwidth"], mfu=m["mfu"], op_overhead=m["op_overhead"],
                      source=f"measured {m['measured_at']} on {m['host']} with {n} ranks at once; mfu fitted "
                             f"to a local step of {REFERENCE}")
    op_links = {op: Link(float(v["bandwidth"]), float(v["latency"])) for op, v in m["links"].items()}
    loopback = op_links["all_reduce"]
    found = Cluster("this-machine", gpu, n, loopback, loopback, 0.0, source=gpu.source + "; links: loopback (gloo)",
                    op_links=op_links, overlap=m["overlap"],
                    notes={"measurements": {k: v for k, v in m.items() if k != "records"}})
    if link is None:
        return found
    # An emulated link's time is a sleep on top of the loopback's (`toolkit.comm.emulate`): it takes no core,
    # so what it models hides behind compute as a separate link's would; its latency is delay in flight,
    # not occupancy (`toolkit.comm.cost`), so the next message may leave while the last one's latency runs.
    return found.with_changes(name="this-machine (emulated link)", gpus_per_node=link.ranks_per_node,
                              inter=link.inter, intra=link.intra or loopback, overlap=1.0,
                              latency_holds_link=False,
                              op_links={} if link.intra is not None or link.ranks_per_node == 1 else op_links,
                              source=found.source + f"; {link.describe()}")


def this_machine(world_size: int = 2, *, refresh: bool = False, link: Settings | None = None,
                 quiet: bool = True) -> Cluster:
    """The calibrated cluster for `world_size` ranks on this computer (measured once, then read from the cache).

    link: an emulated interconnect (`toolkit.comm.emulated_link()`); collectives are then charged at its
    alpha-beta model, as the emulation holds them.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}.")
    path = cache_dir() / f"this-machine-w{world_size}.json"
    m = None
    if path.exists() and not refresh:
        try:
            m = json.loads(path.read_text())
        except ValueError:
            m = None
        if m is not None and any(m.get(k) != v for k, v in _key(world_size).items()):
            m = None  # another machine, torch or toolkit version: measure again
    if m is None:
        if not quiet:
            print(f"calibrating this machine with {world_size} ranks (once; cached in {path}) ...", flush=True)
        m = measure(world_size)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(m, default=str))
    return from_measurements(m, link)
