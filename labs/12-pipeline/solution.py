"""Lab 12: 1F1B's action list (PipeDream-Flush, Narayanan et al. 2021). The reference solution."""

from toolkit.parallel.pipeline.schedules import Action


def one_f_one_b(pp: int, microbatches: int, rank: int, virtual_stages: int = 1) -> list:
    """The actions of pipeline rank `rank` (0 .. pp - 1) under 1F1B: a list of Action(kind, micro, stage)."""
    warmup = min(pp - rank - 1, microbatches)
    actions = [Action("F", i, rank) for i in range(warmup)]
    for i in range(microbatches - warmup):
        actions.append(Action("F", warmup + i, rank))
        actions.append(Action("B", i, rank))
    for i in range(microbatches - warmup, microbatches):
        actions.append(Action("B", i, rank))
    return actions
