"""Lab 09's hidden check: graded on the course platform, not released to students (`python -m toolkit release`
leaves this file out). It asks the same question as the public checks on a case they do not try."""
from checks import reference, run  # the public checks' helpers
from toolkit.grading import check


@check("degree 4 on a capacity of 5 (chunks of 2, 1, 1, 1): outputs and input gradients", points=1,
       world_sizes=(2,))
def uneven_degree(student, ctx):
    outs, grads_x, _, _ = reference(ctx.world_size)
    out, gx, _ = run(student, ctx, 4, backward=True)
    ctx.expect(out, outs[ctx.rank], f"rank {ctx.rank}'s outputs at degree 4", exact=False)
    ctx.expect(gx, grads_x[ctx.rank], f"rank {ctx.rank}'s input gradient at degree 4", exact=False)
