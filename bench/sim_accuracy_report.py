"""bench/sim_accuracy.py's report: a table of predicted against measured step times, and whether the ranking holds."""

from __future__ import annotations

NOISE = 0.10  # two measured steps closer than this are a tie on a shared machine


def ranking(predicted: dict, measured: dict) -> str:
    """Whether ordering by predicted step time gives the measured order; swapped pairs whose measured times
    differ by less than NOISE are ties, listed apart."""
    by_p = sorted(predicted, key=predicted.get)
    by_m = sorted(measured, key=measured.get)
    swapped = [(a, b) for i, a in enumerate(by_m) for b in by_m[i + 1 :] if by_p.index(a) > by_p.index(b)]
    real = [(a, b) for a, b in swapped if measured[b] > (1 + NOISE) * measured[a]]
    text = f"measured {' < '.join(by_m)}; predicted {' < '.join(by_p)}: "
    if not swapped:
        return text + "the same order"
    text += (
        f"{len(real)} pair(s) swapped beyond the {NOISE:.0%} noise"
        + (": " if real else "")
        + ", ".join(f"{a} / {b} ({measured[a] * 1e3:.1f} vs {measured[b] * 1e3:.1f} ms measured)" for a, b in real)
    )
    ties = len(swapped) - len(real)
    return text + (f"; {ties} more within it" if ties else "")


def table(world: int, machine, rows: list) -> str:
    m = machine.notes["measurements"]
    trust = machine.notes["trust"]
    curve = ", ".join(f"{r / 1e9:.0f}" for _, r in m["gemm_rates"]["fp32"])
    beside = m["beside_compute"]
    lines = [
        f"World size {world}: calibrated GEMM rates {curve} GFLOP/s fp32 per rank (4 MFLOP to 0.5 GFLOP "
        f"products), {m['op_overhead'] * 1e6:.1f} µs per operation, {m['memory_bandwidth'] / 1e9:.1f} GB/s; "
        f"reference step {m['reference_step_s'] * 1e3:.1f} ms (spread ±{trust['spread'] / 2:.0%}) at load "
        f"{trust['load_then']:.1f} per core, {trust['model']:.2f}x what the per-operation model gives it at "
        f"those rates; timed again beside the strategies, the machine ran {trust['speed']:.2f}x as fast "
        f"(load {trust['load_now']:.1f} per core): rates scaled so the model reproduces it then; loopback "
        f"all-reduce α = {machine.op_links['all_reduce'].latency * 1e6:.0f} µs, "
        f"1/β = {machine.op_links['all_reduce'].bandwidth / 1e9:.2f} GB/s (collectives timed with compute "
        f"between calls){_in_groups(machine)}, overlap {machine.overlap:.2f} (the fraction of a collective that hides "
        f"behind "
        f"compute; the emulated link's sleep hides whole); a reduce-scatter of "
        f"{beside['size_bytes'] / 2**20:.1f} MiB in flight beside compute takes "
        f"{beside['reduce_scatter_in_flight_s'] * 1e3:.2f} ms against {beside['reduce_scatter_alone_s'] * 1e3:.2f} "
        f"ms alone ({beside['stretch']:.2f}x; the column 'with the in-flight stretch' charges it to every "
        f"asynchronous collective), and an all-gather called behind it "
        f"{beside['all_gather_behind_s'] * 1e3:.2f} ms.",
        "",
        "| case | predicted step (ms) | measured step (ms) | error | with each calibration (ms) | "
        "with the in-flight stretch | predicted split: compute / exposed / hidden comm (ms) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        b = r["breakdown"]
        each = " / ".join(f"{t * 1e3:.1f}" for t in r.get("each", [r["predicted"]]))
        flat = f"{r['flat'] / r['measured'] - 1:+.0%}" if "flat" in r else "-"
        lines.append(
            f"| {r['name']} | {r['predicted'] * 1e3:.1f} | {r['measured'] * 1e3:.1f} | "
            f"{r['predicted'] / r['measured'] - 1:+.0%} | {each} | {flat} | {b['compute'] * 1e3:.1f} / "
            f"{b['exposed_comm'] * 1e3:.1f} / {b['overlapped_comm'] * 1e3:.1f} |"
        )
    return "\n".join(lines)


def how_priced(world: int, machine, moe: dict) -> str:
    """What the model prices of this machine's collectives beyond each one's alpha-beta, with this run's numbers:
    gloo's collectives two at a time, and an emulated call's loopback part on the cores (issue 30)."""
    text = (
        f"Priced at {world} ranks: gloo runs {machine.collective_lanes} of a group's collectives at once (its worker "
        f"threads, read from the live group), so an all-gather called behind an asynchronous reduce-scatter starts "
        f"at once instead of queueing (the pair measured on its own: 'What the simulator's misses on this machine "
        f"pay' below), and a collective's hold on the cores ({1 - machine.overlap:.2f} of it) stalls the next "
        f"compute, not the next collective nor the views dispatched between them."
    )
    pipelined = moe.get("moe pipeline 4")
    if pipelined is not None and not isinstance(pipelined, str):
        spans = [s for s in pipelined.cost.timelines[-1].spans if s.kind == "comm" and s.cost.cores is not None]
        priced, cores = (sum(getattr(s.cost, k) for s in spans) * 1e3 for k in ("seconds", "cores"))
        booked, marked = (getattr(pipelined.cost.cluster, k) * 1e3 for k in ("bookings", "marks"))
        text += (
            f" Under the emulated link each call is the real loopback call, then a sleep to the emulated time (an "
            f"all-to-all books its chunks on the job's store first, {booked:.2f} ms at issue as calibrated; a ring "
            f"collective or a barrier marks its issue there and reads its peers' marks after, {marked:.2f} ms): the "
            f"pipelined MoE layer's {len(spans)} calls are priced at {priced:.1f} ms, of which their "
            f"bookings and loopback part hold the cores {cores:.1f} ms (the calibrated overlap of the all-to-all "
            f"beneath; the sleep hides whole)."
        )
        late = pipelined.cost.cluster.late_peers
        if late:
            text += (
                f" Its time runs from the group's last issue, and on the shared cores the last rank issued "
                f"{late[0][1] * 1e3:.2f} to {max(y for _, y in late) * 1e3:.2f} ms after a rank that had computed "
                f"{late[0][0] * 1e3:.1f} to {late[-1][0] * 1e3:.1f} ms since its previous call (measured: "
                + ", ".join(f"{y * 1e3:.2f} ms after {x * 1e3:.1f}" for x, y in late)
                + "), charged by each call's compute before it."
            )
    return text


def _in_groups(machine) -> str:
    """The all-reduce's fit in each smaller group size the calibration measured, every group at once."""
    fits = sorted((k[1], v) for k, v in machine.op_links.items() if isinstance(k, tuple) and k[0] == "all_reduce")
    return "".join(
        f"; in groups of {n}, every group at once, α = {v.latency * 1e6:.0f} µs, 1/β = {v.bandwidth / 1e9:.2f} GB/s"
        for n, v in fits
    )


def as_before(rows: list) -> str:
    """The same programs priced with gloo's collectives one at a time and an emulated call's sleep alone (the model
    before issue 30's second pass), with every group on the world's fit (before each group size was measured), and
    with every rank issuing each emulated call together (before the late peers were measured), on the same
    calibration and measurements: what those mechanisms change."""
    error = lambda r, key: r[key] / r["measured"] - 1  # noqa: E731
    within = sum(abs(error(r, "queued")) <= 0.2 for r in rows)
    moved = [
        f"{r['name']} {error(r, 'queued'):+.0%}" for r in rows if abs(error(r, "queued") - error(r, "predicted")) > 0.02
    ]
    text = (
        f"Priced with one collective at a time and an emulated call's sleep alone (the model before): {within} of "
        f"{len(rows)} within 20%" + (f"; the rows that move: {', '.join(moved)}." if moved else ".")
    )
    fitted = [r for r in rows if "world_fit" in r]
    moved = [
        f"{r['name']} {error(r, 'world_fit'):+.0%}"
        for r in fitted
        if abs(error(r, "world_fit") - error(r, "predicted")) > 0.02
    ]
    within = sum(abs(error(r, "world_fit")) <= 0.2 for r in fitted)
    text += (
        f" Priced with every group's collectives on the world's fit (before each group size was measured): {within} "
        f"of the {len(fitted)} strategy rows within 20%"
        + (f"; the rows that move: {', '.join(moved)}." if moved else ".")
    )
    emulated = [r for r in rows if "together" in r]
    moved = [f"{r['name']} {error(r, 'together'):+.0%}" for r in emulated]
    within = sum(abs(error(r, "together")) <= 0.2 for r in emulated)
    return text + (
        f" Priced with every rank issuing each emulated call together (before the late peers were measured): {within} "
        f"of the {len(emulated)} MoE rows within 20% ({', '.join(moved)})."
        if emulated
        else ""
    )
