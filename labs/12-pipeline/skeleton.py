"""Lab 12: 1F1B's action list (PipeDream-Flush, Narayanan et al. 2021), written by you.

One function is yours: `one_f_one_b`. A pipeline schedule is one list of actions per rank, and nothing else:
the toolkit's driver (`toolkit/parallel/pipeline/`) puts in the receive before each action that needs a
neighbour's data and the send after it, and runs the list in its order. Read README.md first (and notebook 09,
sections 1 and 4), then grade your work with

    python -m toolkit grade labs/12-pipeline                     # grades this file
    python -m toolkit grade labs/12-pipeline --solution my.py    # or a copy of it
"""

from toolkit.parallel.pipeline.schedules import Action  # noqa: F401 - what the list holds


# --- yours -------------------------------------------------------------------------------------------------
def one_f_one_b(pp: int, microbatches: int, rank: int, virtual_stages: int = 1) -> list:
    """Rank `rank`'s actions under 1F1B: a list of Action(kind, micro, stage), with stage = rank (0 .. pp - 1).

    Action("F", i, rank) is micro-batch i's forward on this rank's stage: it needs micro-batch i's activation
    from stage rank - 1 (the first stage reads the tokens) and sends its own to stage rank + 1.
    Action("B", i, rank) is its backward: it needs the gradient of micro-batch i from stage rank + 1 (the last
    stage starts from the loss) and sends its input's gradient to stage rank - 1. Between a micro-batch's F and
    its B, this rank keeps that micro-batch's activations.

    What the list must achieve, for every pp >= 2 and microbatches = m >= pp:
    - every micro-batch's F and B exactly once on this rank, each B after its F;
    - memory: never more than pp - rank micro-batches held at once (GPipe, every F first, holds m: the reason
      1F1B exists);
    - no deadlock: with every rank running its own list, each receive is eventually matched by a send;
    - no avoidable wait: a rank starts a backward as soon as its gradient can have arrived, so that with a
      forward costing 1 and a backward 2 every rank idles only GPipe's bubble, (pp - 1) / (m + pp - 1) of the step.
    How many forwards rank r runs before its first backward is yours to work out (README, "1F1B").
    `virtual_stages` is always 1 here (the driver passes it to every schedule; the interleaved one uses it).
    """
    raise NotImplementedError("one_f_one_b: not written yet")
