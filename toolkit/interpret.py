"""What the comparison's numbers mean: one line per surprise in `python -m toolkit compare`'s table.

A table that says dp takes four times ddp's step time, or that moe-ep sent 0.623 MB against a theory
of 0.64, leaves a student guessing. Each line here states the number, then the reason, with the
counts that show it taken from the same trace: how many collectives a step issued, how much of their
time hid behind compute, how many rows the MoE routing actually sent. A line appears only when its
strategies are in the table. Pure functions of rows and Runs; nothing runs.
"""

from __future__ import annotations

import statistics

from .trace.analysis import step_windows


def collectives_per_step(run, rank: int) -> int:
    """The median number of collectives `rank` issued per training step (its "comm" spans)."""
    windows = step_windows(run, rank)
    calls = [sum(start <= e["start"] <= end for e in run.comm_events(rank)) for start, end in windows]
    return round(statistics.median(calls)) if calls else 0


def routed_rows_bytes(run, rank: int, row_bytes: int, experts_per_rank: int) -> float:
    """The bytes of token rows `rank` sent per step (median) as its recorded routing asks: in each MoE
    forward it dispatches its kept rows for other ranks' experts and returns the rows it computed for
    other ranks; backward sends both again. Dropped choices and rows for its own experts never travel."""
    per_step: dict = {}
    for m in run.metrics:
        if m["name"].startswith("moe/") and m["name"].endswith("/load") and m.get("rank", 0) == rank:
            v = m["value"]
            own = range(v["first"], v["first"] + experts_per_rank)
            away = sum(k for e, k in enumerate(v["kept"]) if e not in own)
            returned = sum(v["received"]) - sum(v["kept"][e] for e in own)
            per_step[m["step"]] = per_step.get(m["step"], 0) + 2 * (away + returned) * row_bytes
    return statistics.median(per_step.values()) if per_step else 0.0


def _ratio(rows, slow: str, fast: str) -> float | None:
    if slow in rows and fast in rows and rows[fast]["step ms"] > 0:
        return rows[slow]["step ms"] / rows[fast]["step ms"]
    return None


def phase_ms(run, name: str) -> float:
    """The median length (ms) of the compute spans called `name` ("backward", "optimizer") over every rank."""
    lengths = [e["end"] - e["start"] for e in run.events if e["cat"] == "compute" and e["name"] == name]
    return round(1e3 * statistics.median(lengths), 1) if lengths else 0.0


def _faster_than_ddp(rows, runs) -> str | None:
    """Why zero1/zero2 can step faster than ddp on a CPU: not bytes (the same) nor much of the 1/N optimizer
    step, but fewer calls, each paying a fixed cost, where overlap hides little (the ranks fill the cores)."""
    faster = [z for z in ("zero1", "zero2") if z in rows and z in runs and rows[z]["step ms"] < rows["ddp"]["step ms"]]
    if not faster or "ddp" not in runs:
        return None
    ddp = rows["ddp"]
    said = " and ".join(
        f"{z} ({rows[z]['step ms']} ms, {rows[z]['collectives/step']} collectives per step, "
        f"backward {phase_ms(runs[z], 'backward')} ms)"
        for z in faster
    )
    one = len(faster) == 1
    return (
        f"{said} {'steps' if one else 'step'} faster than ddp ({ddp['step ms']} ms) though "
        f"{'it sends' if one else 'they send'} the same bytes, and hardly because a sharded optimizer step "
        f"updates 1/N of the parameters (ddp's whole AdamW step takes "
        f"{phase_ms(runs['ddp'], 'optimizer')} ms here). ddp sends its gradients in {ddp['collectives/step']} "
        f"bucket all-reduces and waits for the last of them at the end of backward (its backward: "
        f"{phase_ms(runs['ddp'], 'backward')} ms); a ZeRO step makes one reduce-scatter and one all-gather. On "
        f"this machine each call pays a fixed cost of milliseconds (the alpha of the collectives' alpha-beta "
        f"fit), and the ranks "
        f"already fill the cores, so ddp's overlap hides little of it. On GPUs, where NCCL moves the data beside "
        f"the computation, ddp's overlap is what wins."
    )


def notes(rows, runs, *, moe: dict | None = None) -> list[str]:
    """The lines that explain the table (rows as `toolkit.compare_table.summarize` makes them)."""
    rows = {r["strategy"]: r for r in rows}
    out = []
    ratio = _ratio(rows, "dp", "ddp")
    if ratio is not None:
        dp, ddp = rows["dp"], rows["ddp"]
        out.append(
            f"dp takes {ratio:.1f}x ddp's step time for the same bytes: dp issues {dp['collectives/step']} "
            f"all-reduces per step, one per gradient tensor, after backward, each blocking (overlap "
            f"{dp['overlap']:.0%}); ddp sends the same gradients in {ddp['collectives/step']} buckets, each "
            f"launched while backward goes on (overlap {ddp['overlap']:.0%})."
        )
    ratio = _ratio(rows, "zero3", "fsdp")
    if ratio is not None:
        z3, fsdp = rows["zero3"], rows["fsdp"]
        out.append(
            f"zero3 takes {ratio:.1f}x fsdp's step time for the same bytes and memory: zero3 gathers and "
            f"frees parameters one module at a time (every Linear, LayerNorm, Embedding: "
            f"{z3['collectives/step']} collectives per step, each waited for before the module runs); fsdp "
            f"does it per transformer block ({fsdp['collectives/step']} per step) and prefetches the next "
            f"block's parameters during backward. Every collective pays a fixed cost."
        )
    if "zero1" in rows and "ddp" in rows:
        out.append(
            f"zero1 and zero2 send what ddp sends ({rows['ddp']['sent MB/step']} MB per step: a "
            "reduce-scatter plus an all-gather move the bytes of one all-reduce) and hold less: the "
            "optimizer states (zero1), and the gradients too (zero2), are split over the ranks."
        )
    if "ddp" in rows:
        out += [line for line in [_faster_than_ddp(rows, runs)] if line]
    if "local" in rows:
        out.append(
            "local runs on one rank: nothing to send and nothing to overlap (n/a); it is the oracle "
            "whose loss every other strategy matches."
        )
    if moe is not None and "moe-ep" in rows and "moe-ep" in runs:
        row, run = rows["moe-ep"], runs["moe-ep"]
        routed = (
            row["theory sent MB/step"] * 1e6
            - moe["rows"]
            + routed_rows_bytes(run, run.ranks[0], moe["row_bytes"], moe["experts_per_rank_per_layer"])
        )
        out.append(
            f"moe-ep sent {row['sent MB/step']} MB per step against a theory of "
            f"{row['theory sent MB/step']} MB that assumes balanced routing with nothing dropped. In this run "
            f"rank {run.ranks[0]} sent fewer token rows: choices over an expert's capacity are dropped, and "
            f"rows for the rank's own experts stay home. Counting the rows its recorded routing sent gives "
            f"{routed / 1e6:.3f} MB."
        )
    return out
