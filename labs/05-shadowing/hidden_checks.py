"""Lab 05's hidden checks: graded on the course platform, not released to students (`python -m toolkit release`
leaves this file out). They compare your functions with the toolkit's own latency model and Algorithm 1 (which the
released checks may not import: they are the answer), on cases drawn for each grading and on a real layer's
counts."""

from checks import as_ids, close, pure_cases, pure_returned, real_inputs  # the public checks' helpers

from toolkit.grading import List, check, number
from toolkit.moe import shadow

MODEL = ("latency_imbalanced", "latency_shadowed")


@check(
    "worker_loads and the latency model on cases drawn for this grading: the values of the README's formulas",
    points=2,
    world_sizes=(2,),
    pure=True,
    task="pure",
    cases=pure_cases,
    returns=pure_returned,
    feedback="worker_loads, latency_imbalanced or latency_shadowed is wrong on a case drawn for this grading: "
    "compare each with the README's formulas on a case of your own, by hand",
)
def values(ctx, given, got):
    for name, call in given[0]["calls"].items():
        if call["fn"] == "choose_shadows":
            continue
        want = getattr(shadow, call["fn"])(*call["args"], **call["kwargs"])
        mine = got[0][name]
        fits = all(map(close, mine, want)) if call["fn"] == "worker_loads" else close(mine, want)
        if not fits:
            ctx.fail(
                f"{call['fn']}({', '.join(map(str, call['args']))}, {call['kwargs']}) = {number(mine)}, "
                f"expected {number(want)}"
            )


@check(
    "choose_shadows on cases drawn for this grading: Algorithm 1's choice",
    points=1,
    world_sizes=(2,),
    pure=True,
    task="pure",
    cases=pure_cases,
    returns=pure_returned,
    feedback="on a case drawn for this grading your rule chose differently from Algorithm 1: check where the search "
    "stops (README, 'Algorithm 1')",
)
def choice(ctx, given, got):
    case = given[0]
    want = shadow.choose_shadows(case["counts"], case["owners"], **case["model"])
    if got[0]["choice"] != want.shadowed:
        ctx.fail(
            f"counts {case['counts']}, owners {case['owners']}: chose {got[0]['choice']}, Algorithm 1 chooses "
            f"{want.shadowed}.\n" + want.explain()
        )


@check(
    "on a real layer's counts (skewed, balanced, slow link): the same choice as Algorithm 1",
    points=1,
    world_sizes=(2,),
    task="real_counts",
    cases=real_inputs,
    returns={"choice": List(int)},
    feedback="on a real layer's counts your rule chose differently from Algorithm 1: compare it with the "
    "README's steps on a case of your own",
)
def algorithm_on_real_counts(ctx, given, got):
    case = given[0]
    chosen = as_ids(ctx, got[0]["choice"], ctx.case, case["E"])
    want = shadow.choose_shadows(case["table"], case["owners"], **case["model"])
    if chosen != want.shadowed:
        ctx.fail(
            f"{ctx.case}: counts {case['table']}: chose {chosen}, Algorithm 1 chooses {want.shadowed}.\n"
            + want.explain()
        )
