"""The "this-machine" preset: this computer's rates, measured once with every rank busy, cached on disk.

A prediction is only as good as its constants. For the GPU presets they come from datasheets and a
GEMM microbenchmark (`toolkit.sim.hardware`); for this computer they are measured, by the same ranks
a real run would use (N processes sharing its cores, all at once, so each rank measures its share):

- compute (`calibrate_compute`): GEMM FLOP/s by size, the host cost of one operation, memory bandwidth,
  and a small reference GPT's local step, timed several times;
- collectives (`calibrate_links`): each one's cost as a step pays it, the fraction that hides behind
  compute, and how much longer one takes in flight beside compute and another collective;
  `toolkit.comm.fit.fit_alpha_beta` fits alpha and beta to each operation apart (gloo runs a reduce-scatter
  as an all-reduce, so one fit for all would mislead).

The cost model prices a step's recorded operations on these rates (`toolkit.sim.kernel_time`, a CPU's
rules), scaled by one constant per machine: the reference step's measured time over what the model
predicts for it (a small GPT that is not the model being predicted, as a GEMM microbenchmark is not the
training run for a GPU preset; it takes in what a CPU's kernels pay beyond the rates measured apart).
How far to trust a prediction is measured too (`trust`): the reference step's spread while
calibrating and the machine's load then and now. A shared machine's load changes by the minute:
`from_measurements(m, reference_step_s=...)` takes the reference step timed again beside what is
predicted and scales to that instead. The in-flight stretch of a collective beside compute is measured
and reported (`m["beside_compute"]`), not charged: charging it to every asynchronous collective made the
predictions worse (docs/benchmarks.md).

The result is cached as JSON under the cache folder (``$TOOLKIT_CACHE_DIR``, else
``$XDG_CACHE_HOME/toolkit``, else ``~/.cache/toolkit``), keyed by host, torch version, core count and
world size; `this_machine(world_size, refresh=True)` measures again.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import time
from pathlib import Path

from ..comm.emulate import Link, Settings
from .calibrate_compute import REFERENCE, measure_compute, reference_step  # noqa: F401 - reference_step: benches
from .calibrate_links import SIZES, measure_links
from .cost import compute_time
from .hardware import THIS_MACHINE, Accelerator, Cluster
from .program import Compute

VERSION = 9  # 7: the emulated link's bookkeeping (calibrate_links.emulator_bookings); 8: its issue marks, and
#                each smaller group's collectives (calibrate_links.subgroups); 9: how late the last peer issues
#                (calibrate_late.late_peers)
OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")


def cache_dir() -> Path:
    base = os.environ.get("TOOLKIT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "toolkit"
    )
    return Path(base) / "sim"


def _key(world_size: int) -> dict:
    import torch

    return {
        "version": VERSION,
        "host": platform.node(),
        "torch": torch.__version__,
        "cores": os.cpu_count(),
        "world_size": world_size,
        "reference": REFERENCE,
    }


def load_now() -> float:
    """The machine's one-minute load average (runnable processes), 0 where the system does not say."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def _on_rank(ops, sizes, reference) -> dict:
    return {**measure_compute(reference), **measure_links(ops, sizes)}


def measure(world_size: int, *, timeout_s: float = 240.0) -> dict:
    """Launch `world_size` ranks and measure; compute rates are the slowest rank's."""
    from ..comm.fit import fit_alpha_beta
    from ..runtime import launch

    load_before = load_now()
    results = launch(_on_rank, world_size, args=(OPS, SIZES, REFERENCE), timeout_s=timeout_s)
    links, group_links = {}, {}
    for op in OPS:
        for k in sorted({r["world_size"] for r in results[0]["records"]}):
            # a size whose calls added nothing measurable to the loop (0 s: below the machine's noise) says nothing
            # about alpha or beta; fit the others, and call the op free where none is left
            usable = [r for r in results[0]["records"] if (r["op"], r["world_size"]) == (op, k) and r["seconds"] > 0]
            alpha, beta = fit_alpha_beta(usable, impl=None) if len(usable) >= 2 else (1e-9, 0.0)
            link = {"bandwidth": 1 / beta if beta > 0 else 1e15, "latency": max(alpha, 1e-9)}
            if k == world_size:
                links[op] = link
            else:  # a smaller group, while the other groups run theirs (`calibrate_links.subgroups`)
                group_links.setdefault(str(k), {})[op] = link
    slowest_curve = {
        dtype: [
            (flops, min(r["gemm_rates"][dtype][i][1] for r in results))  # the slowest rank's
            for i, (flops, _) in enumerate(results[0]["gemm_rates"][dtype])
        ]
        for dtype in ("fp32", "bf16")
    }
    return dict(
        _key(world_size),
        measured_at=time.strftime("%Y-%m-%d %H:%M"),
        gemm_rates=slowest_curve,
        flops={k: max(r for _, r in v) for k, v in slowest_curve.items()},
        op_overhead=max(r["op_overhead"] for r in results),
        memory_bandwidth=min(r["memory_bandwidth"] for r in results),
        reference_step_s=max(r["reference_step_s"] for r in results),
        reference_spread=max(r["reference_spread"] for r in results),
        load=(load_before + load_now()) / 2,
        links=links,
        group_links=group_links,
        overlap=results[0]["overlap"],
        beside_compute=results[0]["beside_compute"],
        lanes=results[0]["lanes"],
        emulator_bookings=max(r["emulator_bookings"] for r in results),
        emulator_marks=max(r["emulator_marks"] for r in results),
        late_peers=results[0]["late_peers"],  # every rank's issues, gathered: the same on each
        records=results[0]["records"],
    )


def trust(m: dict, speed: float = 1.0, model: float = 1.0) -> dict:
    """How far to trust a prediction from measurement `m`: the calibration's own spread, the load then and now.

    spread: the reference step's interquartile range over its median while calibrating (one step of the
    machine may sit that far from the typical one); load: runnable processes per core then and now;
    speed: how much faster the machine is now than when calibrated (the reference step timed beside the
    prediction, 1 where it was not timed again); model: the reference step's measured time over what the
    per-operation model predicts for it at the calibrated rates (what the CPU kernel model misses)."""
    cores = m.get("cores") or 1
    then, now = m.get("load", 0.0) / cores, load_now() / cores
    note = (
        f"calibrated {m.get('measured_at', '?')} at load {then:.1f} per core (reference step spread "
        f"±{m.get('reference_spread', 0) / 2:.0%}); the reference step takes {model:.2f}x what the "
        f"per-operation model predicts at the calibrated rates, which are scaled by it; load now {now:.1f} per core"
    )
    if speed != 1.0:
        note += f"; the machine runs {speed:.2f}x as fast as then (reference step timed again beside the run)"
    elif now > 1.5 * max(then, 0.5):
        note += (
            "; the load has grown since: compute will be slower than predicted (time the reference step "
            "beside the run and pass it to from_measurements, or calibrate again with refresh=True)"
        )
    return {
        "spread": m.get("reference_spread", 0.0),
        "load_then": then,
        "load_now": now,
        "speed": speed,
        "model": model,
        "note": note,
    }


def _accelerator(m: dict, speed: float) -> Accelerator:
    """This machine's rates as measured, every one scaled by `speed` (work per second)."""
    n = m["world_size"]
    rates = {dtype: tuple((f, r * speed) for f, r in points) for dtype, points in m["gemm_rates"].items()}
    peak = {"fp32": m["flops"]["fp32"] * speed, "bf16": m["flops"]["bf16"] * speed, "fp16": m["flops"]["bf16"] * speed}
    return Accelerator(
        f"this machine ({n} ranks on {m['cores']} cores)",
        peak,
        memory_bytes=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        memory_bandwidth=m["memory_bandwidth"] * speed,
        op_overhead=m["op_overhead"] / speed,
        asynchronous=False,
        gemm_rates={**rates, "fp16": rates["bf16"]},
        source=f"measured {m['measured_at']} on {m['host']} with {n} ranks at once",
    )


@functools.lru_cache(maxsize=1)
def _reference_program() -> tuple:
    """The reference step's compute segments, recorded once per process on a one-rank simulated cluster (as
    `simulate(tiny_gpt, "local", 1)` records them, from the pieces below it: this module sits under the pricing
    that asks it for "this-machine")."""
    import torch

    from .. import parallel
    from ..models import tiny_gpt
    from .build import build_on_meta
    from .cluster import cluster
    from .watched_step import measure_steps, train_step

    with cluster(1, 0):
        model = build_on_meta(functools.partial(tiny_gpt, **REFERENCE["model"]))
        model, opt = parallel.wrap(model, "local", optimizer=torch.optim.AdamW)
        x = torch.empty((REFERENCE["batch"], REFERENCE["model"]["seq_len"]), dtype=torch.long, device="meta")
        train_step(model, opt, x, x, step=0)  # Adam makes its states in its first step: measure a steady one
        program = measure_steps(model, opt, x, x, 1, meta=True, first=1)["programs"][-1]
    return tuple(c for c in program if isinstance(c, Compute))


def reference_seconds(gpu: Accelerator) -> float:
    """What the per-operation model predicts for the reference step on `gpu` (compute only: it has no collective)."""
    return sum(compute_time(c, gpu, "fp32") for c in _reference_program())


def from_measurements(m: dict, link: Settings | None = None, *, reference_step_s: float | None = None) -> Cluster:
    """The Cluster a measurement describes; `link` (an emulated interconnect) replaces the loopback.

    Compute: the measured rates, scaled so that the per-operation model reproduces the reference step (a small
    GPT that is not the model being predicted; the one constant per machine, as the GEMM microbenchmark is for
    a GPU). reference_step_s: the reference step timed again (a benchmark times it beside what it predicts, so
    that the machine's load is the same for both): the rates are then scaled to that time instead.
    """
    measured = reference_step_s or m["reference_step_s"]
    modelled = reference_seconds(_accelerator(m, 1.0))
    gpu = _accelerator(m, modelled / measured)
    n = m["world_size"]
    notes = trust(m, m["reference_step_s"] / measured, m["reference_step_s"] / modelled)
    op_links = {op: Link(float(v["bandwidth"]), float(v["latency"])) for op, v in m["links"].items()}
    op_links.update(  # a smaller group's own, measured beside the others (`calibrate_links.subgroups`)
        ((op, int(k)), Link(float(v["bandwidth"]), float(v["latency"])))
        for k, by_op in m.get("group_links", {}).items()
        for op, v in by_op.items()
    )
    loopback = op_links["all_reduce"]
    found = Cluster(
        THIS_MACHINE,
        gpu,
        n,
        loopback,
        loopback,
        0.0,
        source=gpu.source + "; links: loopback (gloo)",
        op_links=op_links,
        overlap=m["overlap"],
        collective_lanes=int(m.get("lanes", 1)),
        notes={"measurements": {k: v for k, v in m.items() if k != "records"}, "trust": notes},
    )
    if link is None:
        return found
    # An emulated link's time is a sleep on top of the loopback's (`toolkit.comm.emulate`): it takes no core,
    # so what it models hides behind compute as a separate link's would; its latency is delay in flight,
    # not occupancy (`toolkit.comm.cost`), so the next message may leave while the last one's latency runs.
    return found.with_changes(
        name="this-machine (emulated link)",
        gpus_per_node=link.ranks_per_node,
        inter=link.inter,
        intra=link.intra or loopback,
        overlap=1.0,
        beside_compute=1.0,
        latency_holds_link=False,
        collective_lanes=1,  # one emulated card: its messages queue on it (`toolkit.comm.cost`)
        underlay=found,  # each emulated call is a real loopback call, then a sleep to the modelled time
        bookings=float(m.get("emulator_bookings", 0.0)),  # and an all-to-all's bookings on the job's store first
        marks=float(m.get("emulator_marks", 0.0)),  # or a ring collective's issue marks there
        late_peers=tuple((float(x), float(y)) for x, y in m.get("late_peers", ())),  # its time runs from the last issue
        op_links={} if link.intra is not None or link.ranks_per_node == 1 else op_links,
        source=found.source + f"; {link.describe()}",
    )


def this_machine(
    world_size: int = 2, *, refresh: bool = False, link: Settings | None = None, quiet: bool = True
) -> Cluster:
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
