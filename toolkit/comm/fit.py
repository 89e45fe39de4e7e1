"""The alpha-beta model fitted to measured collectives: what a figure overlays on its measurements and what the
simulator's calibration of this machine prices links with (`toolkit.sim.calibrate`), so both read one fit, and the
simulator needs no plotting library to calibrate.
"""

from __future__ import annotations

import math

import numpy as np

from ..memory.formulas import alpha_beta_time
from .measure import records_from_run


def fit_alpha_beta(data, impl: str | None = "ring") -> tuple[float, float]:
    """Fit the alpha-beta model time = steps·alpha + wire_bytes·beta to measured times.

    Least squares on relative error (times span orders of magnitude, and a 1 ms miss on a 4 KiB
    message matters more than on a 4 MiB one), constrained to alpha, beta >= 0. `impl` picks which
    records to fit ("ring" by default: the model describes the ring's steps; None fits all).
    Steps and bytes per collective come from `toolkit.memory.alpha_beta_time` itself, so the fit and
    the formula cannot disagree about the algorithm.
    """
    given = records_from_run(data) if hasattr(data, "metrics") else data  # a list of records, or a Run with them
    records = [r for r in given if impl is None or r["impl"] == impl]
    if not records:
        raise ValueError(f"no records with impl={impl!r} to fit; pass impl=None to fit all of them.")
    steps = np.array([alpha_beta_time(r["op"], r["size_bytes"], r["world_size"], 1.0, 0.0) for r in records])
    wire = np.array([alpha_beta_time(r["op"], r["size_bytes"], r["world_size"], 0.0, 1.0) for r in records])
    t = np.array([r["seconds"] for r in records])
    a = np.stack([steps / t, wire / t], axis=1)  # rows scaled by 1/t: relative error
    b = np.ones_like(t)
    best, best_error = (0.0, 0.0), math.inf
    for free in ((0, 1), (0,), (1,)):  # the unconstrained fit, then each parameter alone
        coef = np.zeros(2)
        coef[list(free)] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
        if (coef >= 0).all():
            error = float(np.sum((a @ coef - b) ** 2))
            if error < best_error:
                best, best_error = (float(coef[0]), float(coef[1])), error
    return best
