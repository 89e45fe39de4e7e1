"""Lab 12's hidden check: graded on the course platform, not released to students (`python -m toolkit release`
leaves this file out). It computes 1F1B's warm-up by its formula, which is the lab's question: the released checks
judge the warm-up only through what it implies (the memory bound, no deadlock, the bubble)."""

from checks import layouts, lists_returned, shown, well_formed  # the public checks' helpers

from toolkit.grading import check


@check(
    "warm-up: each rank runs as many forwards before its first backward as 1F1B allows, then pairs, then backwards",
    points=1,
    world_sizes=(2,),
    pure=True,
    task="lists",
    cases=layouts,
    returns=lists_returned,
    feedback="some rank's order is not 1F1B's: warm-up forwards, then forward/backward pairs, then the backwards "
    "left (README, '1F1B')",
)
def warm_up(ctx, given, got):
    pp, m, actions = well_formed(ctx, given, got)
    for rank, mine in enumerate(actions):
        kinds = "".join(a.kind for a in mine)
        warmup = min(pp - rank - 1, m)
        expected = "F" * warmup + "FB" * (m - warmup) + "B" * warmup
        if kinds != expected:
            ctx.fail(
                f"pp={pp}, microbatches={m}, rank {rank} runs {kinds} ({shown(mine)}); 1F1B's rank {rank} runs "
                f"{warmup} warm-up forward(s) (pp - rank - 1: the stages after it must fill before its first "
                f"gradient can come back), then forward/backward pairs, then the remaining backwards: {expected}"
            )
