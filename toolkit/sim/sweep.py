"""Where does a strategy stop fitting, or stop scaling? Step time and memory over world sizes, quickly.

Simulating every layer of a 96-layer model for every (strategy, world size) takes minutes. But the layers of a
transformer are identical, so whatever a rank spends per step grows by the same amount with each layer: memory (each
category, at each moment of the step), FLOPs and step time are affine in the number of layers, f(L) = f(3) + (L - 3)
x (f(4) - f(3)). The peak is the highest of the moments extrapolated (`deepest_peak`): two depths need not peak at
the same moment. `sweep` simulates each case with three and with four layers (so that a layer in the middle of the
stack, prefetched from both sides, is what gets repeated: with two layers there is no middle, and the peak happens
elsewhere, e.g. before FSDP's first reduce-scatter; with one block in k checkpointed, two depths k apart, `depths`)
and extrapolates to the model's depth; `tests/test_sim_cost.py` holds the extrapolation to a whole-model simulation.
One exception: exposed communication shrinks when another layer's compute hides more of it, and cannot go below
zero; where its line would, the deeper model hides it all (step = compute).

    rows = sweep(presets.zero_7_5b, layers=36, strategies={"ddp": {}, "zero3": {}}, worlds=(8, 64, 512),
                 cluster="dgx-a100", mixed_precision=True)

Under pipeline parallelism (a strategy's options with pp=) the stages' blocks are what repeats: one and two
blocks per stage are simulated (`PIPELINE_BASE`), the rest extrapolated, the bubble and transfers with them, and
checked against a simulation of four (`simulate_depths`): the step is affine in the blocks only while the
pipeline keeps its regime, and a shallow stage's own exposed waits can hide the bubble a deeper one pays.

Each row says whether the whole model's peak fits in the cluster's GPU memory (`fits`, `fit`: the verdict,
its headroom and what would make it fit); a case that does not fit has no step time, TFLOP/s or MFU (None).
"""

from __future__ import annotations

from types import SimpleNamespace

from ..parallel import checkpointing
from ..units import bytes_text, seconds_text
from .breakdown import WAITING
from .fit import check_fit
from .priced import resolve
from .simulate import simulate

BASE = (3, 4)  # the depths simulated
PIPELINE_BASE = (1, 2)  # under pp: blocks per stage simulated (every stage's blocks are alike; no prefetch between)
PIPELINE_CHECK = 4  # under pp: the blocks per stage simulated again to check the extrapolation
AFFINE = 0.01  # the most the extrapolation may miss the check's step by (a fraction of it) and still be used


def extrapolate(one, two, layers: int, at: tuple = BASE) -> dict:
    """The numbers of an L-layer model from priced simulations of its `at`-layer versions. Under pipeline
    parallelism `layers` and `at` count blocks per stage (per virtual stage with interleaving), and the step is
    also made of the bubble and the transfers, each affine in the blocks per stage while the slowest stage
    stays the slowest (the first or last: the embedding, the head)."""

    def _affine(x: float, y: float, n: float = layers) -> float:
        return x + (n - at[0]) * (y - x) / (at[1] - at[0])

    a, b = one.cost, two.cost
    first, second = a.breakdown, b.breakdown
    busy = [k for k in first if k not in ("exposed_comm", "overlapped_comm", "compute", "step")]
    breakdown = {k: max(_affine(first[k], second.get(k, 0.0)), 0.0) for k in busy}
    exposed = max(_affine(first["exposed_comm"], second["exposed_comm"]), 0.0)
    step = sum(breakdown.values()) + exposed
    comm = _affine(first["exposed_comm"] + first["overlapped_comm"], second["exposed_comm"] + second["overlapped_comm"])
    breakdown.update(
        exposed_comm=exposed,
        compute=sum(v for k, v in breakdown.items() if k not in WAITING),
        overlapped_comm=max(comm - exposed, 0.0),
        step=step,
    )
    band = {end: max(_affine(a.band[end], b.band[end]), 0.0) for end in ("worst", "best")}
    flops = _affine(one.flops, two.flops)
    useful = _affine(a.useful_flops[-1], b.useful_flops[-1])
    peak_memory = deepest_peak(one, two, _affine)
    whole = SimpleNamespace(  # the L-layer model, as the verdict reads a Simulation
        peak=sum(peak_memory.values()),
        peak_memory=peak_memory,
        strategy=one.strategy,
        options=one.options,
        world_size=one.world_size,
        batch_per_rank=one.batch_per_rank,
        accumulation=one.accumulation,
        seq_len=one.seq_len,
        num_params=_affine(one.num_params, two.num_params),
        expert_params=_affine(one.expert_params, two.expert_params),
        expert_parallel=one.expert_parallel,
    )
    fit = check_fit(whole, a.cluster)
    peak_flops = a.cluster.gpu.flops_per_s(a.dtype)
    share = useful / flops if flops else 1.0  # the average rank's work over this rank's
    model_flops = _affine(a.model_flops[-1], b.model_flops[-1]) * share
    ran = fit.fits
    return {
        "step_time": step if ran else None,
        "flops": flops,
        "useful_flops": useful,
        "tflops_per_gpu": useful / step / 1e12 if ran else None,
        "mfu": model_flops / step / peak_flops if ran else None,
        "hfu": useful / step / peak_flops if ran else None,
        "peak": whole.peak,
        "peak_memory": peak_memory,
        "states": _affine(one.memory["total"], two.memory["total"]),
        "num_params": whole.num_params,
        "fits": ran,
        "fit": fit,
        "breakdown": breakdown,
        "band": band,
        "layers": layers,
    }


def deepest_peak(one, two, affine) -> dict:
    """The deeper model's peak, by category: at every moment of the step that both simulations have (a pass, a
    phase and a module, a block named by its place: the first, a middle one, the last), the bytes of each category
    extrapolated, and the moment whose total is the highest. Two depths need not peak at the same moment (a short
    model at a large embedding's gradient, a deep one at the end of forward, where every layer's activations are
    held), so extrapolating each one's peak would mix moments; each moment on its own is affine in the layers."""
    a, b = _by_place(one.moments), _by_place(two.moments)
    both = a.keys() & b.keys()
    if both:
        moment = max(both, key=lambda m: affine(sum(a[m].values()), sum(b[m].values())))
        return {k: max(affine(a[moment].get(k, 0), b[moment].get(k, 0)), 0.0) for k in set(a[moment]) | set(b[moment])}
    categories = set(one.peak_memory) | set(two.peak_memory)  # no moment recorded (a Simulation made by hand)
    return {k: max(affine(one.peak_memory.get(k, 0), two.peak_memory.get(k, 0)), 0.0) for k in categories}


def _by_place(moments: dict) -> dict:
    """{(pass, phase, module with its block's index replaced by "first", "middle" or "last", action): categories},
    the middle blocks' highest kept (the index: the first number in the module's name, "blocks.3.mlp" -> 3). A lone
    block is both the first and the last (a pipeline stage of one block: its deeper version has two, a first and
    a last, and the deepest's peak is usually in its last)."""

    def split(module: str):
        parts = module.split(".")
        at = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        return (None, module) if at is None else (int(parts[at]), ".".join(parts[:at] + ["{}"] + parts[at + 1 :]))

    indices = [split(m)[0] for _, _, m, _ in moments if split(m)[0] is not None]
    ends = (("first", min(indices, default=None)), ("last", max(indices, default=None)))
    out: dict = {}
    for (pass_, phase, module, action), categories in moments.items():
        index, name = split(module)
        places = [name]
        if index is not None:
            places = [name.format(place) for place, at in ends if index == at] or [name.format("middle")]
        for place in places:
            key = (pass_, phase, place, action)
            if key not in out or sum(categories.values()) > sum(out[key].values()):
                out[key] = categories
    return out


def sweep(
    model_fn, *, layers: int, strategies: dict, worlds, cluster="dgx-a100", progress=None, warmup: bool = True, **common
) -> list:
    """One row per (strategy, world size): step time, TFLOP/s per GPU, MFU and HFU, peak memory, whether it fits.

    model_fn(n_layer=...) builds the model (a preset of `toolkit.models.presets`); strategies maps a label
    to (strategy, options) or to options of the strategy named by the label; common: options for every
    case (mixed_precision, batch_per_rank, seq_len, ...). progress: a callable told each case's label.
    warmup: measure a steady step (True: Adam's states exist through it, as in every step but the first; a
    first step's peak leaves them out, and with them what a data-parallel or hybrid rank mostly holds).
    """
    rows = []
    for label, spec in strategies.items():
        strategy, options = spec if isinstance(spec, tuple) else (label, spec)
        for world in worlds:
            found = resolve(cluster, world)
            if progress is not None:
                progress(f"{label} x{world}")
            both = {**common, **options}
            stages = both.get("pp", 1) * both.get("virtual_stages", 1)  # under pp: blocks per stage
            if layers % stages:
                raise ValueError(f"{label}: {layers} layers do not split into pp x virtual_stages = {stages} stages.")

            def simulate_at(n, stages=stages, strategy=strategy, world=world, found=found, both=both):
                return simulate(
                    lambda: model_fn(n_layer=n * stages),
                    strategy,
                    world,
                    warmup=warmup,
                    progress=False,
                    cluster=found,
                    **both,
                )

            period = checkpointing.period(both.get("activation_checkpointing", False))
            row, _ = simulate_depths(simulate_at, layers // stages, pipelined=stages > 1, period=period)
            rows.append(dict(row, label=label, strategy=strategy, world_size=world))
    return rows


def depths(blocks: int, period: int = 1) -> tuple[int, int]:
    """The two depths simulated for a model of `blocks` layers that repeat every `period` layers (activation
    checkpointing of every k-th block: `activation_checkpointing=k`): `BASE` for k = 1; else the first depth from
    BASE[0] that leaves the same remainder as `blocks` and one period more (13B's 40 layers at k = 2: 4 and 6), so
    that the layers added are a whole period, one checkpointed block and k - 1 kept, as the model's are."""
    if period <= 1:
        return BASE
    first = BASE[0] + (blocks - BASE[0]) % period
    return first, first + period


def simulate_depths(simulate_at, blocks: int, pipelined: bool, period: int = 1) -> tuple[dict, object]:
    """(`extrapolate`'s numbers, the deepest Simulation run) for a model of `blocks` layers (blocks per stage under
    pp), from simulate_at(n), the Simulation of its n-layer version. Without pp: `BASE` simulated and extrapolated.
    Under pp the step is affine in the blocks per stage only while the pipeline keeps its regime: at one and two
    blocks a stage's waits that do not grow with its blocks (FSDP's embedding gathered again for every
    micro-batch, on the first stage) can cover the bubble, which a deeper stage pays (tp 8 x cp 32 x pp 4 of
    bench/long_context.py's 70B: extrapolated from one and two blocks to twenty, 6.4 s; simulated whole, 7.7 s, its
    bubble 1.8 s). So `PIPELINE_CHECK` blocks are simulated too, and where the extrapolation from `PIPELINE_BASE`
    misses that step by more than `AFFINE` of it, the whole stage is simulated (exact, and as slow as its blocks);
    a stage of up to `PIPELINE_CHECK` blocks is simulated whole in any case. The numbers say which in "checked".
    The check is not a proof: a bend that starts deeper passes it (FSDP, d_model 256, pp 4, 8 micro-batches:
    -0.2% at four blocks, -2.1% at eight). Blocks checkpointed one in `period` (`depths`): without pp, depths a
    period apart; under pp the stage simulated whole. The numbers say which depths were simulated in "depths"."""
    if not pipelined:
        at = depths(blocks, period)
        sims = [simulate_at(n) for n in at]
        return dict(extrapolate(*sims, blocks, at), checked="extrapolated", depths=at), sims[-1]
    if blocks <= PIPELINE_CHECK or period > 1:
        whole = simulate_at(blocks)
        return dict(extrapolate(whole, whole, blocks, (0, 1)), checked="simulated whole", depths=(blocks,)), whole
    one, two, check = (simulate_at(n) for n in (*PIPELINE_BASE, PIPELINE_CHECK))
    guess = extrapolate(one, two, PIPELINE_CHECK, PIPELINE_BASE)["breakdown"]["step"]
    miss = guess / check.cost.step_time - 1
    how = f"({miss:+.1%} at {PIPELINE_CHECK} blocks)"
    if abs(miss) <= AFFINE:
        extrapolated = extrapolate(one, two, blocks, PIPELINE_BASE)
        return dict(extrapolated, checked=f"extrapolated {how}", depths=PIPELINE_BASE), check
    whole = simulate_at(blocks)
    return dict(extrapolate(whole, whole, blocks, (0, 1)), checked=f"simulated whole {how}", depths=(blocks,)), whole


KEEPS = 0.1  # a rate that moves less than this fraction "keeps" it


def describe(rows) -> list[str]:
    """One sentence per label of `sweep`'s rows, from the smallest world to the largest: the rate and where it
    goes, with the exposed communication that moves it; or where it does not fit, and by how much."""
    out = []
    for label in dict.fromkeys(r["label"] for r in rows):
        mine = sorted((r for r in rows if r["label"] == label), key=lambda r: r["world_size"])
        ran = [r for r in mine if r["fits"]]
        missing = [r for r in mine if not r["fits"]]
        words = []
        if len(ran) >= 2:
            first, last = ran[0], ran[-1]
            change = last["tflops_per_gpu"] / first["tflops_per_gpu"] - 1
            trend = (
                "keeps its rate"
                if abs(change) < KEEPS
                else f"{'loses' if change < 0 else 'gains'} {abs(change):.0%} of its rate"
            )
            words.append(
                f"{trend}: {first['tflops_per_gpu']:.3g} TFLOP/s per GPU at {first['world_size']} GPUs, "
                f"{last['tflops_per_gpu']:.3g} at {last['world_size']} (exposed communication "
                f"{seconds_text(first['breakdown']['exposed_comm'])} -> "
                f"{seconds_text(last['breakdown']['exposed_comm'])} of a "
                f"{seconds_text(first['step_time'])} -> {seconds_text(last['step_time'])} step)"
            )
        elif ran:
            words.append(f"{ran[0]['tflops_per_gpu']:.3g} TFLOP/s per GPU at {ran[0]['world_size']} GPUs")
        if missing:
            worst = max(missing, key=lambda r: r["peak"])
            words.append(
                f"does not fit at {', '.join(str(r['world_size']) for r in missing)} GPUs (peak up to "
                f"{bytes_text(worst['peak'])}, {bytes_text(worst['fit'].capacity)} per GPU)"
            )
        out.append(f"{label} " + "; ".join(words))
    return out
