"""Issue 6's MoE systems options side by side: shadowing, Tutel's pipelining, FasterMoE's smart schedule.

One MoE layer (the toolkit's, expert parallel over all ranks, gloo on the CPU) under Zipf-skewed
routing, forward + backward, in six variants built with the same seed, hence the same weights and the
same routing: the plain path; ``shadow="auto"`` (FasterMoE's Algorithm 1 picks experts to copy to
every rank); ``pipeline_degree`` 2, 4 and 8 (Tutel: chunks along the capacity, the next chunk's
all-to-all overlapping this chunk's experts); ``schedule="smart"`` (FasterMoE: per-peer steps). Every
variant computes the same function (tests/test_moe_systems.py and tests/test_moe_shadow.py prove it).
Each repetition runs every variant once, back to back, in an order that rotates; a pass is timed on
every rank and the slowest rank's time counts. Reported: the median time, and the median over
repetitions of plain / variant (paired, so a slow moment of this shared machine hits both sides).

Links. On loopback (no emulation) communication is nearly free next to the two shared cores, which no
GPU cluster resembles. The emulated links (``toolkit.comm.emulate``) set the balance on purpose, from
a measurement: the plain path is first run on loopback, which gives the slowest rank's expert compute
(forward + backward) and the bytes its dispatch/combine all-to-alls move; then

    comparable   bandwidth such that the link's model time for that traffic equals the compute: R_CC = 1
    slow         ten times less: R_CC = 0.1 (communication-bound)

both with 0.5 ms per message (small next to a pass's transfers, tens of ms, as ~10 us is next to a
~1 ms dispatch on a GPU cluster). Why these two: by FasterMoE's model R_CC = 3·alpha·H·W_net / (s·P),
so its MoE-GPT-S (H = 1024, alpha = 2, fp16) on V100s (P ~ 30-50 TFLOP/s) sits at R_CC ~ 0.8-1.3 on
100 Gb/s InfiniBand and ~0.1 on 10 Gb/s: the links stand in for those two networks for this small
layer. The bandwidths are derived from the measurement, never from the results, and are printed. The
calibration is a closed loop (``settle``): a short run of every variant on the calibrated link, and while the plain
path's R_CC is more than 5% off, the link is calibrated again on its passes (at most twice); the report lists each
probe's R_CC.

Predicted ideal speedups:

- overlap (pipelining, smart schedule): (comm + comp) / max(comm, comp) from the plain path's trace:
  comm the slowest rank's link time for dispatch and combine, forward and backward (the emulated
  model's time; on loopback the time spent inside them, waiting for the straggler included, so an
  upper bound), comp the slowest rank's expert compute, forward (the layer's spans) and backward
  (timed by marks this bench puts around the plain variant's experts);
- shadowing: Lat_imbl / Lat_shadow of FasterMoE's model for the experts Algorithm 1 chose, as the layer
  records them (P measured here, W_net the emulated link or, on loopback, measured).

    python bench/moe_systems.py [--world-sizes 2,4] [--links loopback,comparable,slow] [--repeats 9]
                                [--rounds 3] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time

import benchlib  # bench/benchlib.py (a bench runs as a script: its folder is on sys.path)
import torch
import torch.distributed as dist

import toolkit

CONFIG = dict(d=128, ff=512, per_rank=2, tokens=1024, top_k=2, zipf=1.5)
LINKS = {  # name -> R_CC the link is calibrated for (see calibrate); None: loopback, no emulation
    "loopback": None,
    "comparable": 1.0,
    "slow": 0.1,
}
LATENCY_S = 0.5e-3
PROBES, PROBE_REPEATS, PROBE_TOLERANCE = 2, 3, 0.05  # the link's closed loop (settle): at most 2 corrections
VARIANTS = {
    "plain": {},
    "shadow auto": dict(shadow="auto"),
    "pipeline 2": dict(pipeline_degree=2),
    "pipeline 4": dict(pipeline_degree=4),
    "pipeline 8": dict(pipeline_degree=8),
    "smart": dict(schedule="smart"),
}
EXTRA_VARIANTS = {  # asked for by name (--variants), not in the default table
    "smart g2": dict(schedule="smart", smart_group_size=2),
}
SECTION = "## MoE systems: shadowing, pipelining, smart schedule (bench/moe_systems.py)"


# --- the routing ---------------------------------------------------------------------------------------
def zipf_router(layer, s: float, seed: int = 0) -> None:
    """Zipf-skewed routing: token t's logit for expert e is -s * ln(e + 1) + noise (feature 0 of every
    token is set to 1 by ``zipf_tokens``; the other features give each token unit-variance noise).
    Popularity follows the expert ids, so the hottest experts share rank 0: the straggler case."""
    E, d = layer.num_experts, layer.d_model
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        weight = torch.randn(E, d, generator=g) / (d - 1) ** 0.5
        weight[:, 0] = -s * torch.log(torch.arange(1, E + 1, dtype=torch.float32))
        layer.gate.router.weight.copy_(weight)


def zipf_tokens(tokens: int, d: int, rank: int) -> torch.Tensor:
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(1000 + rank))
    x[:, 0] = 1.0
    return x


# --- timing the plain path's expert backward ---------------------------------------------------------------
class _Mark(torch.autograd.Function):
    """Identity; its backward notes the time: "start" where the experts' backward begins (the gradient of
    their output arrives), "end" where it ends (the gradient of their input leaves)."""

    @staticmethod
    def forward(ctx, x, clock, which):
        ctx.clock, ctx.which = clock, which
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock(ctx.which)
        return grad, None, None


def time_expert_backward(layer) -> None:
    """Put a ``moe/<name>/experts`` span with backward=True around the plain path's expert backward."""
    from toolkit.trace import recorder

    inner = layer.compute_experts
    state = {}

    def clock(which):
        if which == "start":
            state["start"] = recorder.mark()
        elif "start" in state and recorder.enabled:
            recorder.add(
                f"moe/{layer.name}/experts",
                "compute",
                state.pop("start"),
                recorder.mark(),
                backward=True,
                rows=state.get("rows", 0),
            )

    def compute_experts(received, plan):
        state["rows"] = int(received.shape[0])
        out = inner(_Mark.apply(received, clock, "end"), plan)
        return _Mark.apply(out, clock, "start")

    layer.compute_experts = compute_experts


# --- on every rank -------------------------------------------------------------------------------------
def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # raw: bookkeeping, not part of any layer's trace
    return t.item()


def _traffic(events) -> list:
    return [
        e for e in events if e["cat"] == "comm" and str(e["args"].get("moe", "")).startswith(("dispatch", "combine"))
    ]


def _pass_numbers(events, name: str) -> dict:
    """One pass on this rank: link time of dispatch/combine (emulated model, else time inside them) and
    expert compute (forward + backward spans)."""
    from toolkit.trace.analysis import _length, _union

    traffic = _traffic(events)
    if traffic and all("emulated_s" in e["args"] for e in traffic):
        sends = sum(e["args"]["emulated_s"] for e in traffic if e["name"] != "recv")
        receives = sum(e["args"]["emulated_s"] for e in traffic if e["name"] != "send")
        comm = max(sends, receives)
    else:
        comm = _length(_union((e["start"], e["end"]) for e in traffic))
    experts = [e for e in events if e["cat"] == "compute" and e["name"] == f"moe/{name}/experts"]
    comp = _length(_union((e["start"], e["end"]) for e in experts))
    wire = sum(max(e["args"]["bytes_sent"], e["args"]["bytes_recv"]) for e in traffic)
    messages = sum(len(e["args"]["group"]) - 1 if e["name"] == "all_to_all" else 1 for e in traffic)
    return {"comm": comm, "comp": comp, "wire_bytes": wire, "messages": messages}


def slowest_median(passes_by_rank, key: str) -> float:
    """Per pass, the slowest rank's number; the median over passes."""
    return statistics.median(max(p[i][key] for p in passes_by_rank) for i in range(len(passes_by_rank[0])))


def calibrate(passes_by_rank, r_cc: float, latency: float) -> float:
    """The bandwidth (bytes/s) at which the plain path's dispatch/combine traffic, forward and backward,
    takes 1/r_cc times its expert compute on the emulated link (both: the slowest rank's, median over
    passes). The link's model for one all-to-all: peers x latency + max(bytes sent, received) / bandwidth."""
    n_pass = len(passes_by_rank[0])
    comp = slowest_median(passes_by_rank, "comp")
    wire = max(statistics.median(p[i]["wire_bytes"] for i in range(n_pass)) for p in passes_by_rank)
    messages = max(p[0]["messages"] for p in passes_by_rank)
    budget = comp / r_cc - messages * latency
    if budget <= 0:
        raise ValueError(
            f"cannot calibrate a link for R_CC = {r_cc}: {messages} messages of {latency * 1e3:g} ms "
            f"latency already take longer than {comp / r_cc * 1e3:.1f} ms; lower LATENCY_S."
        )
    return wire / budget


def run_link(cfg, variants, repeats, warmup, emulation) -> dict:
    """Every variant on the current link: step times and, per pass, each rank's comm/comp numbers."""
    from toolkit.moe import MoE
    from toolkit.trace import recorder

    rank, world = dist.get_rank(), dist.get_world_size()
    E = cfg["per_rank"] * world
    layers = {}
    for name, options in variants.items():
        layer = MoE(
            cfg["d"], cfg["ff"], E, top_k=cfg["top_k"], dropless=True, seed=0, init_std=0.05, name="bench", **options
        )
        zipf_router(layer, cfg["zipf"])
        if name == "plain":
            time_expert_backward(layer)
        layers[name] = layer
    x = zipf_tokens(cfg["tokens"], cfg["d"], rank).requires_grad_(True)
    times = {name: [] for name in variants}
    passes = {name: [] for name in variants}
    records = {name: [] for name in variants}
    names = list(variants)
    with emulation:
        for i in range(warmup + repeats):
            order = names[i % len(names) :] + names[: i % len(names)]
            for name in order:
                layer = layers[name]
                layer.zero_grad(set_to_none=True)
                x.grad = None
                dist.barrier()
                recorder.reset()
                start = time.perf_counter()
                out, aux = layer(x)
                (out.square().mean() + 0.01 * aux).backward()
                seconds = _slowest(time.perf_counter() - start)
                if i >= warmup:
                    times[name].append(seconds)
                    passes[name].append(_pass_numbers(recorder.events, "bench"))
                    records[name].append({m["name"].split("/")[-1]: m["value"] for m in recorder.metrics})
    return {"times": times, "passes": passes, "records": records}


def _gathered(result) -> list:
    """Every rank's (passes, records) of one ``run_link``, on every rank."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (result["passes"], result["records"]))
    return everyone


def measured_r_cc(passes_by_rank) -> float:
    """R_CC as the table reads it: the slowest rank's expert compute over its link time, median over passes."""
    return slowest_median(passes_by_rank, "comp") / slowest_median(passes_by_rank, "comm")


def settle(cfg, variants, loopback_passes, r_cc: float):
    """The link's bandwidth, closed loop: calibrated on the loopback passes, then, while the plain path measured
    on that link beside the other variants (a short run as the table's) is off its R_CC by more than
    PROBE_TOLERANCE, calibrated again on those passes: the experts compute at another pace once the link sleeps
    between them, and beside the other variants' layers. Returns (bandwidth, each probe's measured R_CC)."""
    bandwidth, probes = calibrate(loopback_passes, r_cc, LATENCY_S), []
    for _ in range(PROBES):
        emulation = toolkit.comm.emulate(bandwidth=bandwidth, latency=LATENCY_S)
        passes = [p["plain"] for p, _ in _gathered(run_link(cfg, variants, PROBE_REPEATS, 1, emulation))]
        probes.append(measured_r_cc(passes))
        if abs(probes[-1] / r_cc - 1) <= PROBE_TOLERANCE:
            break
        bandwidth = calibrate(passes, r_cc, LATENCY_S)
    return bandwidth, probes


def bench(cfg, link_names, variants, repeats, warmup) -> dict:
    """On every rank: every link in turn. Emulated links are calibrated on the plain path measured on
    loopback first (the loopback run itself when it is asked for). Every rank returns the same record."""
    world = dist.get_world_size()
    out = {"world": world, "links": {}}
    todo = list(link_names)
    if any(LINKS[n] is not None for n in todo) and "loopback" not in todo:
        todo.insert(0, "calibration")
    elif "loopback" in todo:
        todo.remove("loopback")
        todo.insert(0, "loopback")
    measured = None
    for link_name in todo:
        if link_name in ("loopback", "calibration"):
            emulation, params, probes = contextlib.nullcontext(), None, []
            chosen = variants if link_name == "loopback" else {"plain": variants["plain"]}
        else:
            bandwidth, probes = settle(cfg, variants, measured, LINKS[link_name])
            params = (bandwidth, LATENCY_S)
            emulation, chosen = toolkit.comm.emulate(bandwidth=bandwidth, latency=LATENCY_S), variants
        result = run_link(cfg, chosen, repeats, warmup, emulation)
        everyone = _gathered(result)
        if measured is None:
            measured = [p["plain"] for p, _ in everyone]
        if link_name != "calibration":
            out["links"][link_name] = {
                "params": params,
                "probes": probes,
                "r_cc_target": LINKS[link_name],
                "times": result["times"],
                "passes": [p for p, _ in everyone],
                "records": [r for _, r in everyone],
            }
    return out


# --- the numbers ---------------------------------------------------------------------------------------
def summarize(link: dict, cfg) -> dict:
    """Median step time per variant, speedups over plain, the predictions, and what the layer decided."""
    times = {name: statistics.median(t) for name, t in link["times"].items()}
    # paired: each repetition ran every variant back to back, so a slow moment of the machine hits all alike
    speedup = {
        name: statistics.median(p / v for p, v in zip(link["times"]["plain"], t)) for name, t in link["times"].items()
    }
    ranks = range(len(link["passes"]))
    plain = [passes["plain"] for passes in link["passes"]]
    comm, comp = slowest_median(plain, "comm"), slowest_median(plain, "comp")
    row = {
        "times": times,
        "speedup": speedup,
        "comm": comm,
        "comp": comp,
        "r_cc": comp / comm if comm > 0 else float("inf"),
        "ideal_overlap": (comm + comp) / max(comm, comp) if max(comm, comp) > 0 else 1.0,
    }
    records0 = link["records"][0]
    if "shadow auto" in records0:
        shadows = [rec["shadow"] for rec in records0["shadow auto"] if "shadow" in rec]
        if shadows:
            row["shadowed"] = statistics.mode(tuple(s["shadowed"]) for s in shadows)
            row["ideal_shadow"] = statistics.median(s["plain_s"] / s["predicted_s"] for s in shadows)
            row["shadow_rates"] = {
                "P": shadows[0]["compute_flops"],
                "W_net": shadows[0]["bandwidth"],
                "source": shadows[0]["source"],
            }
    load = [link["records"][r]["plain"][0]["load"] for r in ranks]
    counts = [sum(c) for c in zip(*(rec["counts"] for rec in load))]
    per_rank = [sum(rec["received"]) for rec in load]
    row["counts"], row["rank_rows"] = counts, per_rank
    row["expert_max_over_mean"] = max(counts) / (sum(counts) / len(counts))
    row["rank_max_over_mean"] = max(per_rank) / (sum(per_rank) / len(per_rank))
    return row


def combined(results: list, cfg) -> dict:
    """{(world, link name): [summary of each round]} in the order measured; a round is one launch."""
    out = {}
    for res in results:
        for link_name, link in res["links"].items():
            out.setdefault((res["world"], link_name), []).append(
                dict(
                    summarize(link, cfg),
                    params=link["params"],
                    probes=link.get("probes", []),
                    r_cc_target=link["r_cc_target"],
                )
            )
    return out


def _spread(values, fmt) -> str:
    """The median over rounds, with the range when there were several."""
    mid = fmt(statistics.median(values))
    return mid if len(values) == 1 else f"{mid} ({fmt(min(values))}-{fmt(max(values))})"


def _fmt_link(name, rounds) -> str:
    if rounds[0]["params"] is None:
        return "loopback (no emulation)"
    bandwidth = _spread([r["params"][0] / 1e6 for r in rounds], lambda v: f"{v:.3g}")
    return f"emulated {name}: {bandwidth} MB/s, {rounds[0]['params'][1] * 1e3:.3g} ms per message"


def table(results: list, cfg) -> str:
    """The markdown report: one row per (world size, link); with several rounds (launches) each number is
    the median over rounds, with the range in parentheses."""
    groups = combined(results, cfg)
    first = next(iter(groups.values()))[0]
    variants = list(first["times"])
    rounds = max(len(g) for g in groups.values())
    repeats = len(results[0]["links"][next(iter(results[0]["links"]))]["times"]["plain"])
    lines = [
        f"gloo on CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, shared with other "
        f"work), torch {torch.__version__}. One MoE layer: d_model {cfg['d']}, d_ff {cfg['ff']}, "
        f"{cfg['per_rank']} experts per rank, top-{cfg['top_k']}, dropless, {cfg['tokens']} tokens per rank, "
        f"Zipf-skewed routing (logit prior -{cfg['zipf']}·ln(e+1), the hottest experts on rank 0), fp32. "
        f"Forward + backward of the layer, the slowest rank's time. {rounds} round(s) (separate launches, "
        f"each calibrating its own links) of {repeats} repetitions; each cell: median ms, then plain / this "
        f"(the median over repetitions, paired: every repetition runs all variants back to back, in rotating "
        f"order)" + (", as the median over rounds with the range over rounds" if rounds > 1 else "") + ".",
        "",
    ]
    head = ["W", "link", "R_CC", *variants, "ideal overlap", "shadow: model", "shadowed"]
    lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for (world, link_name), rs in groups.items():
        cells = [str(world), _fmt_link(link_name, rs), _spread([r["r_cc"] for r in rs], lambda v: f"{v:.2f}")]
        for v in variants:
            ms = f"{statistics.median(r['times'][v] for r in rs) * 1e3:.0f}"
            cells.append(
                ms if v == "plain" else f"{ms}, {_spread([r['speedup'][v] for r in rs], lambda x: f'{x:.2f}x')}"
            )
        cells.append(_spread([r["ideal_overlap"] for r in rs], lambda x: f"{x:.2f}x"))
        shadow = [r["ideal_shadow"] for r in rs if "ideal_shadow" in r]
        cells.append(_spread(shadow, lambda x: f"{x:.2f}x") if shadow else "-")
        sets = sorted({tuple(r["shadowed"]) for r in rs if r.get("shadowed") is not None})
        cells.append(" / ".join(str(list(x)) for x in sets) if sets else "-")
        lines.append("| " + " | ".join(cells) + " |")
    seen = set()
    for (world, _), rs in groups.items():
        s = rs[0]
        if world in seen:
            continue
        seen.add(world)
        lines += [
            "",
            f"Load at world size {world}: (token, choice) pairs per expert {s['counts']} "
            f"(max/mean {s['expert_max_over_mean']:.2f}); rows each rank's experts compute "
            f"{s['rank_rows']} (max/mean {s['rank_max_over_mean']:.2f}).",
        ]
    lines += ["", *closed_loop(groups), "", *targets(results, cfg), "", NOTES]
    return "\n".join(lines)


def closed_loop(groups: dict) -> list:
    """How each emulated link's bandwidth settled (``settle``): the plain path's R_CC on each probe, per round."""
    lines = ["The links' closed loop (the plain path's R_CC on the link as first calibrated, then as corrected):", ""]
    for (world, link_name), rs in groups.items():
        if rs[0]["params"] is not None:
            probes = "; ".join(" -> ".join(f"{x:.2f}" for x in r["probes"]) or "-" for r in rs)
            lines.append(f"- world size {world}, {link_name} (target {rs[0]['r_cc_target']:g}), each round: {probes}.")
    return lines


def targets(results: list, cfg) -> list:
    """Issue 6's targets, read off this run: on the link where communication and compute are comparable,
    pipelining or the smart schedule >= 1.3x over plain, shadowing >= 1.5x under strong skew (the median
    over rounds decides; the range is shown)."""
    lines = ["Targets (issue 6), read off this run:", ""]
    for (world, link_name), rs in combined(results, cfg).items():
        if rs[0]["params"] is None:
            continue
        where = f"world size {world}, {link_name} link (R_CC {statistics.median(r['r_cc'] for r in rs):.2f})"
        overlap = [v for v in rs[0]["speedup"] if v.startswith(("pipeline", "smart"))]
        if overlap:
            best = max(overlap, key=lambda v: statistics.median(r["speedup"][v] for r in rs))
            x = statistics.median(r["speedup"][best] for r in rs)
            shown = _spread([r["speedup"][best] for r in rs], lambda v: f"{v:.2f}x")
            if rs[0]["r_cc_target"] == 1.0:  # the target is set where communication and compute are comparable
                verdict = f"target 1.3x: {'met' if x >= 1.3 else 'missed'}"
            else:
                verdict = (
                    f"ideal {statistics.median(r['ideal_overlap'] for r in rs):.2f}x; the 1.3x target is for "
                    f"the comparable link"
                )
            lines.append(f"- {where}: best overlap {shown} ({best}), {verdict}.")
        if "shadow auto" in rs[0]["speedup"]:
            x = statistics.median(r["speedup"]["shadow auto"] for r in rs)
            shown = _spread([r["speedup"]["shadow auto"] for r in rs], lambda v: f"{v:.2f}x")
            verdict = (
                f"target 1.5x: {'met' if x >= 1.5 else 'missed'}"
                if rs[0]["r_cc_target"] == 1.0
                else "the 1.5x target is for the comparable link"
            )
            lines.append(
                f"- {where}: shadowing {shown}, {verdict} (expert load "
                f"max/mean {rs[0]['expert_max_over_mean']:.2f}, rank load max/mean "
                f"{rs[0]['rank_max_over_mean']:.2f})."
            )
    return lines


NOTES = """How to read it. *R_CC* is measured on each link from the plain path's trace: the slowest rank's expert \
compute (forward + backward) over its link time for dispatch and combine (forward + backward). The emulated links \
are set from a loopback measurement of the same plain path so that R_CC is 1 ("comparable": roughly where \
FasterMoE's MoE-GPT-S sits on V100s with 100 Gb/s InfiniBand, by the paper's model R_CC = 3·α·H·W_net/(s·P)) or 0.1 \
("slow": the same on 10 Gb/s), then corrected in a closed loop: every variant is run on the link for 3 repetitions \
and, while the plain path's R_CC is more than 5% off, the link is calibrated again on those passes, at most twice \
(the experts compute at another pace on the link and beside the other variants' layers than alone on loopback). \
The bandwidths printed are what was used, 0.5 ms per message. *Ideal overlap* is (comm + comp)/max(comm, comp) from \
the plain path's trace; *shadow: model* is FasterMoE's Lat_imbl/Lat_shadow for the experts Algorithm 1 chose, as the \
layer recorded it.

Why the numbers land where they do:

- Pipelining pays while chunks are few; every chunk costs a message's latency (four all-to-alls per chunk, \
forward and backward) and Python overhead, so degree 8 falls behind, as in Tutel's measurements. On loopback \
there is nothing to hide and the chunking only costs. On the slow link it is the other way round, and it can beat \
the "ideal overlap", for the smart schedule's reason below: chunk i's combine leaves the hot rank while chunk \
i + 1's dispatch arrives, the two directions of its link at once, where the plain path uses them in turn; only the \
first chunk's dispatch and the last one's combine travel alone, so more chunks hide more.
- The smart schedule has W - 1 transfers to hide; with 2 ranks only the block a rank keeps for itself overlaps \
the one transfer. On the slow link at 4 ranks it can beat the "ideal overlap": the plain all-to-all holds both \
directions of a rank's link for max(sent, received), while the per-peer sends and receives of different steps \
use the two directions at once. Under skew the hot rank receives much in dispatch and sends much in combine, so \
the full-duplex link is worth up to 2x on its own: a real property of point-to-point schedules, not in the formula.
- The shadowing model is optimistic by design (the paper's): Lat_imbl charges the wire for every row, even rows \
a rank keeps for its own experts, and Lat_shadow charges none of the rows that still travel. It ranks options; \
it does not predict the step.
- Shadowing hides its own traffic (``toolkit/moe/shadow_steps.py``): the weights' broadcast travels while the \
local experts compute, the shadowed expert computes while the combine travels, and the gradients' all-reduce \
travels while the local experts' backward runs. At 2 ranks, shadowing expert 0 (what Algorithm 1 picks) cuts \
the busiest rank's rows from 3079 to about 2170 (0.70x) and the rows the hot rank receives per all-to-all to \
about 0.41x, but adds two transfers of the expert's 0.5 MB of weights (a third of the plain path's link time). \
With comm = comp = 1, done in series that is at best 1/(0.5·0.70 + 0.5·0.41 + 0.5·0.33) ≈ 1.4x, which is what \
the serial version of this path measured (1.23x at 2 ranks, 1.41x at 4, before the overlap); overlapped, the \
bound is 1/max(0.70, 0.74) ≈ 2.7x, less what cannot hide (the dispatch before the first computation, the \
dispatch's backward after the last) and the ranks computing at once on two shared cores. On the slow link \
the layer is communication-bound, so the link time decides: at 2 ranks shadowing leaves 0.74 of it (the rows' \
0.41 plus the weights' 0.33), a bound of about 1.35x before the hidden compute; at 4 ranks the hot rank's rows \
are a larger share of the traffic and the gain is larger.
- Noise: the two cores are shared with other work, so compute times move by tens of percent between runs (the \
emulated link's times do not). Paired medians absorb most of it; repeat the command to see the spread."""


def write_section(path: str, body: str, argv) -> None:
    """This bench's section of ``path`` (``benchlib.write_section``), naming the command with ``argv``."""
    benchlib.write_section(path, SECTION, f"python bench/moe_systems.py {' '.join(argv)}", body)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2")
    parser.add_argument("--links", default=",".join(LINKS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="separate launches; the report gives median and range")
    parser.add_argument("--zipf", type=float, default=CONFIG["zipf"])
    parser.add_argument("--write", help="put the table into this markdown file (its own section)")
    args = parser.parse_args(argv)
    links = [n for n in args.links.split(",") if n]
    known = {**VARIANTS, **EXTRA_VARIANTS}
    unknown = [n for n in args.variants.split(",") if n and n not in known]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {list(known)}")
    variants = {n: known[n] for n in args.variants.split(",") if n}
    if "plain" not in variants:
        parser.error("--variants must include plain (the baseline)")
    bad = set(links) - set(LINKS)
    if bad:
        parser.error(f"unknown links {sorted(bad)}; choose from {sorted(LINKS)}")
    cfg = dict(CONFIG, zipf=args.zipf)
    results = []
    for world in (int(w) for w in args.world_sizes.split(",")):
        for r in range(args.rounds):
            start = time.time()
            results.append(
                toolkit.launch(
                    bench, world, args=(cfg, links, variants, args.repeats, args.warmup), timeout_s=300, quiet=True
                )[0]
            )
            print(f"world size {world}, round {r + 1}/{args.rounds}: {time.time() - start:.0f} s", file=sys.stderr)
    text = table(results, cfg)
    print(text)
    if args.write:
        write_section(args.write, text, argv)
        print(f"written to {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
