"""How a measurement of the collectives reads: message sizes and implementations by name, and a plain table.

The records come from `measure.py` (one per operation, size and implementation); the lessons' figures
(`toolkit.viz`) and the command line's demo print them with these labels, so a table and a plot name
the same row alike.
"""

from __future__ import annotations

from ..units import bandwidth_text

KiB, MiB = 1024, 1024 * 1024


def implementation_label(impl: str, algorithm: str) -> str:
    """How a table names who ran a collective: 'backend (gloo)', 'hand-written ring', 'hand-written
    pairwise' (the all-to-all that `use("ring")` selects), or a plugged-in function's name."""
    if impl == "backend":
        return f"backend ({algorithm})"
    return f"hand-written {algorithm}" if impl == "ring" else impl


def size_label(nbytes: float) -> str:
    """4096 -> '4 KiB', 1048576 -> '1 MiB' (binary units, as message sizes usually are)."""
    for unit, scale in (("GiB", 1024**3), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes:.0f} B"


def _agreement(record) -> str:
    if record["agree"] is None:
        return "-"
    verdict = "yes" if record["agree"] else "NO"
    return f"{verdict} (max diff {record['max_abs_diff']:.1e})"


def _time_label(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def table_rows(records) -> list[dict]:
    """Records as rows of printable strings: operation, implementation, size, time, algbw, busbw, agreement."""
    return [
        {
            "operation": r["op"],
            "implementation": implementation_label(r["impl"], r["algorithm"]),
            "size": size_label(r["size_bytes"]),
            "time": _time_label(r["seconds"]),
            "algbw": bandwidth_text(r["algbw"]),
            "busbw": bandwidth_text(r["busbw"]),
            "agreement": _agreement(r),
        }
        for r in records
    ]


def format_table(records) -> str:
    """A fixed-width text table of the records, one line per measurement, for terminals and logs."""
    rows = table_rows(records)
    if not rows:
        return "(no measurements)"
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(row[c]) for row in rows)) for c in columns}
    right = {"size", "time", "algbw", "busbw"}

    def line(values):
        return "  ".join(v.rjust(widths[c]) if c in right else v.ljust(widths[c]) for c, v in zip(columns, values))

    out = [line(columns), line("-" * widths[c] for c in columns)]
    out += [line(row[c] for c in columns) for row in rows]
    return "\n".join(out)
