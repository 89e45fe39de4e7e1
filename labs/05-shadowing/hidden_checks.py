"""Lab 05's hidden check: graded on the course platform, not released to students (`python -m toolkit release`
leaves this file out). It compares a real layer's choice with the toolkit's own Algorithm 1, which the released
checks may not import (it is the answer)."""
from checks import as_ids, real_inputs  # the public checks' helpers
from toolkit.grading import check
from toolkit.moe.shadow import choose_shadows as reference_choice


@check("on a real layer's counts (skewed, balanced, slow link): the same choice as Algorithm 1", points=1,
       world_sizes=(2,), task="real_counts", inputs=real_inputs,
       feedback="on a real layer's counts your rule chose differently from Algorithm 1: compare it with the "
                "README's steps on a case of your own")
def algorithm_on_real_counts(ctx, given, got):
    for k, case in enumerate(given[0]["cases"]):
        chosen = as_ids(ctx, got[0]["choices"][k], case["name"], case["E"])
        want = reference_choice(case["table"], case["owners"], **case["model"])
        if chosen != want.shadowed:
            ctx.fail(f"{case['name']}: counts {case['table']}: chose {chosen}, Algorithm 1 chooses {want.shadowed}.\n"
                     + want.explain())
