"""The runs of bench/published_runs.py that ran the same code, model and batch on A100s and on H100s, side by side.

Two readings of a pair. `speedups`: the H100 row's rate over the A100 row's, measured and predicted; a cost in
proportion to each GPU's time cancels in it. `unpriced`: the time a token and GPU each run took beyond its compute as
the model prices it, in absolute time, which a ratio hides: about as much on either GPU in these pairs, so the H100's
shorter step shows it as a larger share (docs/differences.md, "The H100 gap", reads it).
"""

from __future__ import annotations

PAIRS = tuple(
    (f"{m}-a100", f"{m}-h100")
    for m in ("mpt-1b", "mpt-7b", "mpt-13b", "llama2-7b", "fa2-gpt3-2.7b", "fms-llama-34b", "fms-llama-70b")
    + ("fms-llama-13b",)
)


def speedups(results) -> dict:
    """{pair: (measured, predicted)}: each H100 row's rate over its A100 twin's (the same code, model and batch), for
    the pairs among `results`. Where the software is the same on both, what it costs in proportion to each GPU's
    time cancels; the same absolute time on both does not (`unpriced`)."""
    found = {r["run"].name: r for r in results}
    out = {}
    for a100, h100 in PAIRS:
        if a100 in found and h100 in found:
            a, h = found[a100], found[h100]
            out[h100.removesuffix("-h100")] = (h["run"].measured / a["run"].measured, h["predicted"] / a["predicted"])
    return out


def unpriced(results) -> dict:
    """{pair: (A100 µs, H100 µs, H100 error with the A100's)}: the time per token and GPU each run of a pair took
    beyond its compute as the model prices it (as if it hid all its traffic), and the H100 row's error had it paid the
    A100 twin's time on top of its own priced compute: where the two runs leave the same time unpriced, that alone
    makes the H100 row miss by more than the A100 row."""
    found = {r["run"].name: r for r in results}
    out = {}
    for a100, h100 in PAIRS:
        if a100 in found and h100 in found:
            (a, a_priced), (h, h_priced) = (_per_token(found[name]) for name in (a100, h100))
            carried = 1 / (h_priced + a) / found[h100]["run"].measured - 1
            out[h100.removesuffix("-h100")] = (a * 1e6, h * 1e6, carried)
    return out


def _per_token(result) -> tuple[float, float]:
    """(seconds a token a GPU the run took beyond its priced compute, seconds its priced compute takes)."""
    measured = 1 / result["run"].measured
    priced = measured / (1 + result["compute_alone"])
    return measured - priced, priced


def summary(results) -> str:
    """The two readings of the pairs among `results`, as bench/published_runs.py prints them after its table."""
    ratios = speedups(results)
    if not ratios:
        return ""
    return (
        "\n\nH100 over A100, the same code and configuration (tokens/s per GPU): "
        + "; ".join(f"{name}: measured {m:.2f}, predicted {p:.2f} ({p / m:.2f}x)" for name, (m, p) in ratios.items())
        + ".\n\nTime a token and GPU each run took beyond its compute as priced (as if it hid its traffic), A100 / "
        "H100, and the H100 row's error had it paid the A100's on top of its own: "
        + "; ".join(f"{name}: {a:.1f} / {h:.1f} µs ({e:+.0%})" for name, (a, h, e) in unpriced(results).items())
        + "."
    )
