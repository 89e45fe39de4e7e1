"""Numbers as a person reads them: a unit chosen from the magnitude, never "0.000 GB" or "3.47e-15 ms".

    bytes_text(2.79e12)    -> "2.79 TB"          bytes_text(106_000)  -> "106 kB"
    count_text(1.06e5)     -> "106K"             count_text(1.75e11)  -> "175B"
    seconds_text(0.0309)   -> "30.9 ms"          seconds_text(3e-18)  -> "0 µs"  (below a microsecond: noise)
    flops_text(2.15e8)     -> "215 MFLOP/s"      flops_text(1.61e14)  -> "161 TFLOP/s"
    percent_text(0.00012)  -> "0.012%"           percent_text(0.437)  -> "43.7%"
    bandwidth_text(4.2e5)  -> "420 kB/s"         bandwidth_text(1.3e10) -> "13 GB/s"  (never "0.000 GB/s")
    byte_unit(8.5e9)       -> (1e9, "GB")        an axis's unit for values up to 8.5e9 bytes
    memory_text(80 * 2**30) -> "85.9 GB (80 GiB)" a device's memory: sold by the GiB ("A100 80GB")

Decimal units (1 GB = 1e9 bytes), as the papers and `toolkit.memory.formulas` count.
"""

from __future__ import annotations

BYTE_UNITS = ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1, "B"))
COUNT_UNITS = ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K"))
TIME_UNITS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"))
NOISE_S = 1e-9  # a duration shorter than this is floating-point residue of a subtraction, not time


def byte_unit(largest: float) -> tuple[float, str]:
    """(bytes per unit, its name) for values up to `largest` bytes: the largest unit that keeps it >= 1."""
    for scale, name in BYTE_UNITS:
        if abs(largest) >= scale:
            return scale, name
    return 1, "B"


def bytes_text(n: float, digits: int = 3) -> str:
    """`n` bytes with `digits` significant digits in the unit its magnitude calls for."""
    scale, name = byte_unit(n)
    return f"{n / scale:.{digits}g} {name}"


def bandwidth_text(rate: float, digits: int = 3) -> str:
    """Bytes per second in the unit its magnitude calls for: a small message's rate is kB/s, not "0.000 GB/s"."""
    return bytes_text(rate, digits) + "/s"


def memory_text(n: float) -> str:
    """A device's memory: bytes_text, and the GiB it is sold as when it is a whole number of them."""
    gib = n / 2**30
    return bytes_text(n) + (f" ({gib:.0f} GiB)" if gib >= 1 and gib == round(gib) else "")


def count_text(n: float, digits: int = 3) -> str:
    """A count (parameters, tokens) with K/M/B/T: 1.06e5 -> "106K", 7.5e9 -> "7.5B", 12 -> "12"."""
    for scale, name in COUNT_UNITS:
        if abs(n) >= scale:
            return f"{n / scale:.{digits}g}{name}"
    return f"{n:.{digits}g}"


def seconds_text(s: float, digits: int = 3) -> str:
    """A duration in s, ms or µs; anything shorter than a nanosecond (either sign) is "0 µs"."""
    if abs(s) < NOISE_S:
        return "0 µs"
    for scale, name in TIME_UNITS:
        if abs(s) >= scale:
            return f"{s / scale:.{digits}g} {name}"
    return f"{s / 1e-6:.{digits}g} µs"


RATE_UNITS = ((1e15, "PFLOP/s"), (1e12, "TFLOP/s"), (1e9, "GFLOP/s"), (1e6, "MFLOP/s"), (1e3, "kFLOP/s"))


def flops_text(rate: float, digits: int = 3) -> str:
    """A rate in FLOP/s with the prefix its magnitude calls for: 2.15e8 -> "215 MFLOP/s"."""
    for scale, name in RATE_UNITS:
        if abs(rate) >= scale:
            return f"{rate / scale:.{digits}g} {name}"
    return f"{rate:.{digits}g} FLOP/s"


def percent_text(fraction: float, digits: int = 3) -> str:
    """A fraction as a percentage with `digits` significant digits: a small one is not printed as "0.0%"."""
    value = fraction * 100
    if value == 0 or abs(value) >= 1:
        return f"{value:.1f}%"
    return f"{value:.{digits - 1}g}%"
