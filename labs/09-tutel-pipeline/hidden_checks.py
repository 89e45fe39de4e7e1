"""Lab 09's hidden check: graded on the course platform, not released to students (`python -m toolkit release`
leaves this file out). It asks the same question as the public checks on a case they do not try."""

from checks import judge_gradients, pipeline_inputs, ran_backward  # the public checks' helpers

from toolkit.grading import check


@check(
    "degree 4 on a capacity of 5 (chunks of 2, 1, 1, 1): outputs and input gradients",
    points=1,
    world_sizes=(2,),
    task="gradients",
    cases=pipeline_inputs(4),
    returns=ran_backward,
    feedback="a degree that does not divide the capacity went wrong: try chunks of different sizes yourself",
)
def uneven_degree(ctx, given, got):
    judge_gradients(ctx, given, got)
