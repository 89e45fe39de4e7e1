"""What the formulas accept, and the errors that say so: a student passes a world size of 0 or a strategy's
name misspelled, and is told what was wrong and which values are valid."""

from __future__ import annotations

ZERO_STAGES = (0, 1, 2, 3)
STRATEGIES = ("local", "dp", "ddp", "zero1", "zero2", "zero3", "fsdp")
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")
FSDP_SHARDING = ("hybrid", "full_replication", "full_shard")


# --- checks that speak to a student -------------------------------------------------------------


def _check_count(name: str, value, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum or value != value:
        raise ValueError(f"{name} must be a number >= {minimum}, got {value!r}")


def _check_world(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer (1, 2, 3, ...), got {value!r}")


def _check_choice(name: str, value, valid) -> None:
    if value not in valid or isinstance(value, bool):
        raise ValueError(f"unknown {name} {value!r}; valid values: {', '.join(map(repr, valid))}")
