"""Model states per rank under data parallelism and ZeRO 1, 2, 3, as plain numbers: what the memory explorer shows.

`explorer_numbers(Ψ, N, K, precision)` is a pure function (no widgets, no figure), so what the panel of
`explorer.py` draws can be tested without a screen: bytes of parameters, gradients and optimizer states per
rank for each stage, the stage's formula in the ZeRO paper's notation, and, for a device's memory, whether it
fits and the largest model that would. The bytes come from `toolkit.memory.model_states_breakdown`.
"""

from __future__ import annotations

from ..memory import model_states_breakdown

STAGE_NAMES = ("DP (stage 0)", "ZeRO-1", "ZeRO-2", "ZeRO-3")
STAGE_FORMULAS = ("(P+G+K)Ψ", "(P+G)Ψ + KΨ/N", "PΨ + (G+K)Ψ/N", "(P+G+K)Ψ/N")
STAGE_SHARDED = (
    "nothing",
    "optimizer states",
    "optimizer states, gradients",
    "optimizer states, gradients, parameters",
)
PRECISIONS = {  # name -> (bytes per parameter, bytes per gradient)
    "mixed": (2, 2),  # 16-bit (fp16/bf16) parameters and gradients, fp32 states counted in K
    "fp32": (4, 4),
}
GB = 1e9


def _check(num_params, world_size, optimizer_multiplier, precision, device_gb):
    if precision not in PRECISIONS:
        raise ValueError(
            f"unknown precision {precision!r}; choose one of {sorted(PRECISIONS)} "
            "('mixed': 2 + 2 bytes for 16-bit parameters and gradients; 'fp32': 4 + 4)."
        )
    if device_gb is not None and (
        isinstance(device_gb, bool) or not isinstance(device_gb, (int, float)) or device_gb <= 0
    ):
        raise ValueError(f"device_gb must be a positive number of GB (or None), got {device_gb!r}.")
    # num_params, world_size and K are checked by model_states_breakdown, with a student's message


def explorer_numbers(
    num_params: float = 7.5e9,
    world_size: int = 64,
    optimizer_multiplier: float = 12,
    precision: str = "mixed",
    *,
    device_gb: float | None = None,
) -> dict:
    """What the explorer shows, as plain numbers: model states per rank for data parallelism and ZeRO 1-3.

    Returns {"num_params", "world_size", "optimizer_multiplier", "precision", "param_bytes", "grad_bytes",
    "device_gb", "stages": [one dict per stage 0..3], "totals_gb": [4 totals in GB]}. Each stage's dict:
    stage, name, formula (in the paper's notation, P and G the bytes per parameter and per gradient),
    sharded (what the stage partitions), params / grads / optimizer / total (bytes per rank),
    total_gb, bytes_per_param (total / Ψ: what each parameter costs this rank), and, when device_gb is
    given, fits (does it fit in the device) and max_params (the largest Ψ that would, for this N and K).

    >>> [round(t, 1) for t in explorer_numbers()["totals_gb"]]   # the ZeRO paper's Figure 1
    [120.0, 31.4, 16.6, 1.9]
    """
    _check(num_params, world_size, optimizer_multiplier, precision, device_gb)
    param_bytes, grad_bytes = PRECISIONS[precision]
    sizes = dict(param_bytes=param_bytes, grad_bytes=grad_bytes, optimizer_multiplier=optimizer_multiplier)
    stages = []
    for stage in range(4):
        parts = model_states_breakdown(num_params, world_size, stage, **sizes)
        total = sum(parts.values())
        # Every term is (bytes per parameter) x Ψ, so the per-parameter cost does not depend on Ψ.
        per_param = sum(model_states_breakdown(1, world_size, stage, **sizes).values())
        row = {
            "stage": stage,
            "name": STAGE_NAMES[stage],
            "formula": STAGE_FORMULAS[stage],
            "sharded": STAGE_SHARDED[stage],
            **parts,
            "total": total,
            "total_gb": total / GB,
            "bytes_per_param": per_param,
        }
        if device_gb is not None:
            row["fits"] = total <= device_gb * GB
            row["max_params"] = device_gb * GB / per_param if per_param > 0 else float("inf")
        stages.append(row)
    return {
        "num_params": num_params,
        "world_size": world_size,
        "optimizer_multiplier": optimizer_multiplier,
        "precision": precision,
        "param_bytes": param_bytes,
        "grad_bytes": grad_bytes,
        "device_gb": device_gb,
        "stages": stages,
        "totals_gb": [s["total_gb"] for s in stages],
    }
