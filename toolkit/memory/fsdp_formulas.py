"""FSDP's formulas (Zhao et al. 2023): a rank's peak of parameters with units gathered one (or a few) at a
time, the padding that makes a flat parameter split evenly, and the traffic that crosses hosts under full
sharding, hybrid sharding and full replication."""

from __future__ import annotations

from collections.abc import Iterable

from .inputs import FSDP_SHARDING, _check_choice, _check_count, _check_world


def fsdp_peak_params(unit_sizes: Iterable[float], sharding_factor: int, in_flight: int = 1) -> float:
    """Peak parameter elements on a rank with FSDP: Σψ_i/F + in_flight · max ψ_i.

    Every unit i keeps its 1/F shard all the time; only the units being computed (one,
    or more with prefetching) are gathered whole. So wrapping finer lowers the peak.
    (Each flat parameter is padded to a multiple of F: at most F-1 extra elements, ignored here.
    With F = 1 nothing is sharded or gathered, and the peak is just Σψ_i.)
    """
    sizes = list(unit_sizes)
    if not sizes:
        raise ValueError("unit_sizes must list at least one FSDP unit's parameter count")
    for i, s in enumerate(sizes):
        _check_count(f"unit_sizes[{i}]", s)
    _check_world("sharding_factor", sharding_factor)
    if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 0:
        raise ValueError(f"in_flight must be a non-negative integer (units gathered at once), got {in_flight!r}")
    if sharding_factor == 1:
        return float(sum(sizes))
    return sum(sizes) / sharding_factor + in_flight * max(sizes)


def flat_padding(numel: int, world_size: int) -> int:
    """Elements of padding so a flat parameter of ``numel`` splits into ``world_size`` equal shards (< N)."""
    _check_count("numel", numel)
    _check_world("world_size", world_size)
    return -int(numel) % world_size


def fsdp_cross_host_traffic(model_size: float, gpus_per_host: int, world_size: int, sharding: str = "hybrid") -> float:
    """Cross-host traffic per GPU per step (same unit as ``model_size``), from the FSDP paper.

    M = model size, G = GPUs per host, W = GPUs in all.
    full_replication (DDP): all-reduce over W       2M(W-1)/W
    full_shard: 2 all-gathers + 1 reduce-scatter     3M(W-1)/W
    hybrid: shard inside a host, replicate across    2M(W-1)/(GW)
    (hybrid is the paper's expression; counting a ring all-reduce of the M/G shard over the
    W/G replicas exactly gives 2M(W-G)/(GW), the same when W >> G.)
    """
    _check_count("model_size", model_size)
    _check_world("gpus_per_host", gpus_per_host)
    _check_world("world_size", world_size)
    _check_choice("sharding", sharding, FSDP_SHARDING)
    if world_size % gpus_per_host != 0:
        raise ValueError(f"world_size={world_size} must be a multiple of gpus_per_host={gpus_per_host}")
    M, G, W = model_size, gpus_per_host, world_size
    if sharding == "hybrid":
        return 2 * M * (W - 1) / (G * W)
    if sharding == "full_replication":
        return 2 * M * (W - 1) / W
    return 3 * M * (W - 1) / W
