"""Where does a strategy stop fitting, or stop scaling? Step time and memory over world sizes, quickly.

Simulating every layer of a 96-layer model for every (strategy, world size) takes minutes. But the
layers of a transformer are identical, so whatever a rank spends per step grows by the same amount
with each layer: memory, FLOPs and step time are affine in the number of layers, f(L) = f(2) +
(L - 2) x (f(3) - f(2)). `sweep` simulates each case with two and with three layers (so that a layer
in the middle of the stack, prefetched from both sides, is what gets repeated) and extrapolates to
the model's depth; `tests/test_sim_cost.py` holds the extrapolation to a whole-model simulation.

    rows = sweep(presets.zero_7_5b, layers=36, strategies={"ddp": {}, "zero3": {}}, worlds=(8, 64, 512),
                 cluster="dgx-a100", mixed_precision=True)
"""
from __future__ import annotations

from .cost import resolve
from .simulate import simulate


BASE = (2, 3)  # the depths simulated


def _affine(one: float, two: float, layers: int) -> float:
    return one + (layers - BASE[0]) * (two - one)


def extrapolate(one, two, layers: int) -> dict:
    """The numbers of an L-layer model from priced simulations of its BASE-layer versions."""
    step = _affine(one.step_time, two.step_time, layers)
    flops = _affine(one.flops, two.flops, layers)
    model_flops = _affine(one.cost.model_flops[-1], two.cost.model_flops[-1], layers)
    peak = _affine(one.peak, two.peak, layers)
    breakdown = {k: _affine(one.breakdown[k], two.breakdown[k], layers) for k in one.breakdown}
    gpu_peak = one.cost.cluster.gpu.flops_per_s(one.cost.dtype)
    return {"step_time": step, "flops": flops, "tflops_per_gpu": flops / step / 1e12,
            "mfu": model_flops / step / gpu_peak, "hfu": flops / step / gpu_peak, "peak": peak,
            "states": _affine(one.memory["total"], two.memory["total"], layers),
            "fits": peak <= one.cost.cluster.gpu.memory_bytes, "breakdown": breakdown}


def sweep(model_fn, *, layers: int, strategies: dict, worlds, cluster="dgx-a100", progress=None, **common) -> list:
    """One row per (strategy, world size): step time, TFLOP/s per GPU, MFU and HFU, peak memory, whether it fits.

    model_fn(n_layer=...) builds the model (a preset of `toolkit.models.presets`); strategies maps a label
    to (strategy, options) or to options of the strategy named by the label; common: options for every
    case (mixed_precision, batch_per_rank, seq_len, ...). progress: a callable told each case's label.
    """
    rows = []
    for label, spec in strategies.items():
        strategy, options = spec if isinstance(spec, tuple) else (label, spec)
        for world in worlds:
            found = resolve(cluster, world)
            if progress is not None:
                progress(f"{label} x{world}")
            sims = [simulate(lambda n=n: model_fn(n_layer=n), strategy, world, warmup=False, progress=False,
                             cluster=found, **{**common, **options}) for n in BASE]
            rows.append(dict(extrapolate(*sims, layers), label=label, strategy=strategy, world_size=world))
    return rows
