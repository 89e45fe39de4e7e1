"""Lab 12: 1F1B's action list (PipeDream-Flush, Narayanan et al. 2021).

A pipeline schedule is one list of actions per rank: Action("F", i, stage) runs micro-batch i's forward on
the stage, Action("B", i, stage) its backward. The toolkit's driver runs whatever list you return (it puts
in the sends and receives each action needs: `toolkit/parallel/pipeline/lowering.py`), so the order is the
whole schedule. Write the list rank `rank` runs under 1F1B, with one stage per rank (stage = rank):

    warm-up      pp - rank - 1 forwards (never more than there are micro-batches)
    steady state one forward, then one backward, as long as forwards remain
    cool-down    the backwards still owed

Read notebook 09 section 1 first. `toolkit.parallel.pipeline.schedules.show(lists)` prints lists side by side.
"""
from toolkit.parallel.pipeline.schedules import Action


def one_f_one_b(pp: int, microbatches: int, rank: int, virtual_stages: int = 1) -> list:
    """The actions of pipeline rank `rank` (0 .. pp - 1) under 1F1B: a list of Action(kind, micro, stage)."""
    raise NotImplementedError("write 1F1B's action list: warm-up forwards, then forward/backward pairs, then the "
                              "remaining backwards")
