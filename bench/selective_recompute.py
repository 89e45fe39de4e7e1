"""Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"), predicted: sequence
parallelism and selective recomputation against full recomputation, on the runs the paper timed.

The paper's runs (its Tables 3-5; Selene, DGX A100 80GB, mixed precision, sequence 2,048, vocabulary 51,200, no data
parallelism but one run): a 22B GPT on 8 GPUs (tp 8, 4 sequences in one micro-batch), GPT-3 175B on 64 (tp 8 x pp
8, 3 interleaved stages a rank), MT-NLG 530B on 280 (tp 8 x pp 35, 3 interleaved stages) and a 1T GPT on 512 (tp 8
x pp 64), one sequence a micro-batch and one micro-batch a GPU a step; the 530B again on 2,240 GPUs (dp 8, its
gradients all-reduced after backward, nothing overlapped). Each is timed twice: every block recomputed without
sequence parallelism ("full recompute"), and with sequence parallelism and the core attention alone recomputed
("present work": `sequence_parallel=True, activation_checkpointing="attention"`). Table 4 times one layer of the 22B
in five settings, forward and backward apart.

Simulated as `bench/megatron_table.py` simulates SC21's Table 1, with the code the paper's Megatron-LM ran: its
attention kernels (`as_in_papers`, "megatron"), apex's fused Adam, Megatron's reentrant checkpoint, which runs the
checkpointed function again whole (torch's non-reentrant one stops at the last tensor backward needs: for the core
attention, before the product with V), and its column layers' backward collectives overlapped with the weights'
gradients (`tp_comm_overlap="backward"`, which the paper names as the cause of full recomputation's 39%). Priced on
the DGX A100 preset from published measurements of the hardware only; nothing here was used to build or check the
model. `--blocking` prices the runs with every tensor-parallel collective blocking instead. Table 4's layer is priced
twice: as the toolkit runs it, and as Megatron lays it out (`as_megatron_lays_out`: without the copies the toolkit's
batch-first activations add to its tensor-parallel collectives, which Megatron's sequence-first ones do not make).

    .venv/bin/python bench/selective_recompute.py [--runs 22B,175B] [--no-layer] [--blocking] [--write FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import pkgutil
import sys

import benchlib  # bench/benchlib.py (a bench runs as a script: its folder is on sys.path)
from megatron_table import FIELDS, configuration, model, paper_flops, predict

SECTION = "## Sequence parallelism and selective recomputation, predicted (bench/selective_recompute.py)"
TOLERANCE = 0.15
SOURCE = "Korthikanti et al. 2022, arXiv 2205.05198 (MLSys 2023), Tables 3, 4 and 5"
# model: (params (B), heads, hidden, layers, tp, pp, GPUs, global batch), layers per virtual stage (None: 1F1B),
# and Table 5's seconds a step: full recompute, present work (Table 3; section 6: interleaving for 175B and 530B)
RUNS = {
    "22B": ((22, 64, 6144, 48, 8, 1, 8, 4), 4, None, (1.42, 1.10)),
    "175B": ((175, 96, 12288, 96, 8, 8, 64, 64), 1, 4, (18.13, 13.75)),
    "530B": ((530, 128, 20480, 105, 8, 35, 280, 280), 1, 1, (49.05, 37.83)),
    "1T": ((1000, 160, 25600, 128, 8, 64, 512, 512), 1, None, (94.42, 71.49)),
}
DATA_PARALLEL = ("530B", 8, 39.15)  # section 6.3: the 530B at dp 8 (2,240 GPUs), present work
# Every run overlapped its column layers' backward communication with the weights' gradients (section 6.2: "an
# optimization in the backward pass where we overlap all-reduce communication with the linear weight's gradient
# computation"; Megatron-LM's default): tp_comm_overlap="backward"
MEGATRON_2022 = dict(tp_comm_overlap="backward")
SETTINGS = {  # how each column ran: sequence parallelism, what is recomputed
    "full recompute": MEGATRON_2022,
    "present work": dict(MEGATRON_2022, sequence_parallel=True, activation_checkpointing="attention"),
}
# Table 4: one layer of the 22B, (forward, backward) milliseconds
LAYER = {
    name: (dict(MEGATRON_2022, **options), published)
    for name, (options, published) in {
        "baseline, no recompute": ({}, (7.7, 11.9)),
        "sequence parallelism": (dict(sequence_parallel=True), (7.2, 11.8)),
        "full recompute": (dict(activation_checkpointing=True), (7.7, 19.5)),
        "selective recompute": (dict(activation_checkpointing="attention"), (7.7, 13.2)),
        "selective + sequence": (dict(sequence_parallel=True, activation_checkpointing="attention"), (7.2, 13.1)),
    }.items()
}


def run_name(name: str, setting: str, dp: int = 1) -> str:
    """The run's name in `toolkit.sim.held_to_runs` ("korthikanti-530b-dp8-selective")."""
    at = f"-dp{dp}" if dp > 1 else ""
    return f"korthikanti-{name.lower()}{at}-{'full' if setting == 'full recompute' else 'selective'}"


def blocked(options: dict, blocking: bool) -> dict:
    """`options` with every tensor-parallel collective blocking (`--blocking`), or as they are."""
    return {k: v for k, v in options.items() if k != "tp_comm_overlap"} if blocking else options


def run(name: str, setting: str, dp: int = 1, blocking: bool = False) -> dict:
    """A run of Table 3 in one of Table 5's settings, as `megatron_table.predict` reads a row."""
    shape, micro_batch, per_virtual, published = RUNS[name]
    r = dict(zip(FIELDS, (*shape, None)), row=name)
    r.update(gpus=r["gpus"] * dp, batch=r["batch"] * dp)
    r = configuration(r, micro_batch, "local", per_virtual)
    options = blocked(SETTINGS[setting], blocking)
    return dict(r, setting=setting, options=options, published=published[list(SETTINGS).index(setting)])


@contextlib.contextmanager
def as_megatron_recomputes():
    """Megatron's checkpoint is reentrant: a checkpointed function runs again whole in backward."""
    import torch.utils.checkpoint

    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        yield


@contextlib.contextmanager
def as_megatron_lays_out():
    """Megatron's activations are sequence-first, (s, b, h), the toolkit's batch-first, (b, s, h). Megatron's sequence
    all-gathers and reduce-scatters run on whole rows and copy nothing, and its all-reduces sum in place; the toolkit's
    all-gather ends in a copy (`torch.cat` of the ranks' chunks along the sequence), its reduce-scatter starts with one
    (`torch.stack` of them) and its all-reduce sums a clone (`toolkit.parallel.tensor.operators`). Inside, the
    simulated program runs without those copies: the same collectives on views. Only on the simulator's meta tensors,
    which carry no values: on real ones the views would put the wrong rows in place, so it refuses them."""
    import toolkit.parallel
    from toolkit import comm
    from toolkit.parallel.tensor import operators

    for found in pkgutil.walk_packages(toolkit.parallel.__path__, "toolkit.parallel."):  # every holder, imported
        importlib.import_module(found.name)

    def issue(call, label, result, async_op):
        started = operators.InFlight(operators.labelled(call, label), result)
        return started if async_op else started.wait()

    def meta_only(x):
        if not x.is_meta:
            raise RuntimeError("as_megatron_lays_out prices a simulated program (meta tensors); it runs no real one")
        return x.contiguous()

    def all_gather(x, tp, dim, label, async_op=False):
        x = meta_only(x)
        out, shape = x.new_empty((tp.size,) + tuple(x.shape)), list(x.shape)
        shape[dim] *= tp.size
        return issue(
            lambda: comm.all_gather(out, x, group=tp.group, async_op=async_op), label, lambda: out.view(shape), async_op
        )

    def reduce_scatter(x, tp, dim, label, async_op=False):
        x, shape = meta_only(x), list(operators.split(x, tp, dim)[0].shape)
        chunks, out = x.view([tp.size] + shape), x.new_empty(shape)
        return issue(
            lambda: comm.reduce_scatter(out, chunks, group=tp.group, async_op=async_op), label, lambda: out, async_op
        )

    def all_reduce(x, tp, label, async_op=False):
        out = meta_only(x)
        return issue(lambda: comm.all_reduce(out, group=tp.group, async_op=async_op), label, lambda: out, async_op)

    views = [(getattr(operators, f.__name__), f) for f in (all_gather, reduce_scatter, all_reduce)]
    held = [  # every module that holds the toolkit's three (`from .operators import all_gather`) gets the views'
        (module, name, value, view)
        for module in list(sys.modules.values())
        if getattr(module, "__name__", "").startswith("toolkit.parallel")
        for name, value in list(vars(module).items())
        for copying, view in views
        if value is copying
    ]
    for module, name, _, view in held:
        setattr(module, name, view)
    try:
        yield
    finally:
        for module, name, value, _ in held:
            setattr(module, name, value)


def predict_run(r: dict) -> dict:
    """The run's predicted step (`megatron_table.predict`: its MFU counts equation 7's model FLOPs, the paper's),
    against the paper's seconds; the error is the predicted rate's, as every table of the project states it (the
    paper's step over the predicted one, less one: + where the prediction is faster)."""
    with as_megatron_recomputes():
        out = predict(r)
    return dict(out, error=r["published"] / out["step_time"] - 1)


def layer_times(options: dict, megatron_layout: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of one of the 22B's layers: the simulated steps at three and four layers apart
    (`megatron_layout`: without the copies the toolkit's batch-first layout adds, `as_megatron_lays_out`)."""
    from toolkit.sim import simulate
    from toolkit.sim.fused_adam import FusedAdamW

    shape = RUNS["22B"][0]
    heads, hidden, tp = shape[1], shape[2], shape[4]
    whole = options.get("activation_checkpointing") is True  # Megatron's full recomputation, in the model
    wrapper = {k: v for k, v in options.items() if not (whole and k == "activation_checkpointing")}

    def phases(n):
        layout = as_megatron_lays_out() if megatron_layout else contextlib.nullcontext()
        with as_megatron_recomputes(), layout:
            sim = simulate(
                functools.partial(model, n, heads, hidden, whole_blocks=whole),
                "local",
                tp,
                optimizer=FusedAdamW,
                batch_per_rank=RUNS["22B"][1],
                mixed_precision=True,
                progress=False,
                cluster="dgx-a100",
                tp=tp,
                **wrapper,
            )
        timeline = sim.cost.timelines[-1]
        backward = min(s.start for s in timeline.spans if getattr(s.instruction, "phase", "") == "backward")
        optimizer = min(s.start for s in timeline.spans if getattr(s.instruction, "phase", "") == "optimizer")
        return backward - timeline.start, optimizer - backward

    (f3, b3), (f4, b4) = phases(3), phases(4)
    return f4 - f3, b4 - b3


def table5(results: list) -> str:
    lines = [
        "| model | tp x pp x dp | setting | published (s) | predicted (band) | error (rate) | GEMM | attention + "
        "memory-bound | exposed comm | bubble + p2p | MFU | peak memory |",
        "| --- " * 12 + "|",
    ]
    for r in results:
        b, band = r["breakdown"], r["band"]
        share = {k: v / b["step"] for k, v in b.items()}
        seconds = {end: paper_flops(r) / (rate * r["gpus"] * 1e12) for end, rate in band.items()}
        lines.append(
            "| "
            + " | ".join(
                str(c)
                for c in (
                    r["row"],
                    f"{r['tp']} x {r['pp']} x {r['dp']}",
                    r["setting"],
                    f"{r['published']:.2f}",
                    f"{r['step_time']:.2f} ({seconds['best']:.2f}-{seconds['worst']:.2f})",
                    f"{r['error']:+.0%}",
                    f"{share['gemm']:.0%}",
                    f"{share['attention'] + share['memory_bound']:.0%}",
                    f"{share['exposed_comm']:.0%}",
                    f"{share.get('bubble', 0) + share.get('p2p', 0):.0%}",
                    f"{r['mfu']:.1%}",
                    f"{r['fit'].peak / 1e9:.0f} GB{'' if r['fit'].fits else ' (over the 80 GB)'}",
                )
            )
            + " |"
        )
    return "\n".join(lines)


def gains(results: list) -> list[tuple[str, float, float]]:
    """(model, published, predicted) throughput increase of present work over full recompute (Table 5's column)."""
    by = {(r["row"], r["setting"], r["dp"]): r for r in results}
    out = []
    for name, (*_, published) in RUNS.items():
        full, present = by.get((name, "full recompute", 1)), by.get((name, "present work", 1))
        if full and present:
            out.append((name, published[0] / published[1] - 1, full["step_time"] / present["step_time"] - 1))
    return out


def table4(layers: dict, as_megatron: dict) -> str:
    """Table 4 beside the layer predicted twice: as the toolkit runs it, and as Megatron lays it out."""
    base = sum(LAYER["baseline, no recompute"][1])
    lines = [
        "| setting | published forward / backward (ms) | overhead | predicted forward / backward (ms) | overhead | "
        "as Megatron lays it out | overhead |",
        "| --- " * 7 + "|",
    ]
    for name, (_, (forward, backward)) in LAYER.items():
        cells = [f"{name} | {forward} / {backward} | {(forward + backward) / base - 1:+.0%}"]
        for predicted in (layers, as_megatron):
            f, b = (1e3 * x for x in predicted[name])
            cells.append(f"{f:.1f} / {b:.1f} | {(f + b) / 1e3 / sum(predicted['baseline, no recompute']) - 1:+.0%}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default=",".join(RUNS), help=f"of {', '.join(RUNS)}")
    parser.add_argument("--no-layer", action="store_true", help="leave out Table 4 (one layer of the 22B)")
    parser.add_argument(
        "--blocking", action="store_true", help="every tensor-parallel collective blocking, the backward's too"
    )
    parser.add_argument("--write", help="put the section into this markdown file")
    args = parser.parse_args(argv)
    names = [n for n in args.runs.split(",") if n]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"--runs: unknown {unknown}; choose from {', '.join(RUNS)}")
    results = [predict_run(run(name, setting, blocking=args.blocking)) for name in names for setting in SETTINGS]
    if DATA_PARALLEL[0] in names:
        wide = run(DATA_PARALLEL[0], "present work", DATA_PARALLEL[1], args.blocking)
        wide["published"] = DATA_PARALLEL[2]
        results.append(predict_run(wide))
    body = table5(results)
    within = sum(abs(r["error"]) <= TOLERANCE for r in results)
    body += (
        f"\n\n{within} of {len(results)} runs predicted within {TOLERANCE:.0%} ({SOURCE}; the band: every published "
        "measurement of the hardware at either end of its sources' spread). Throughput of present work over full "
        "recompute, published against predicted: "
        + "; ".join(f"{name} {pub:+.1%} / {pred:+.1%}" for name, pub, pred in gains(results))
        + "."
    )
    if not args.no_layer:
        layers, as_megatron = (
            {name: layer_times(blocked(options, args.blocking), megatron) for name, (options, _) in LAYER.items()}
            for megatron in (False, True)
        )
        body += (
            "\n\nOne layer of the 22B (Table 4; the simulated steps at three and four layers apart; as Megatron lays it"
            " out: without the copies the toolkit's batch-first activations add to its tensor-parallel collectives, "
            "`as_megatron_lays_out`):\n\n"
        )
        body += table4(layers, as_megatron)
    print(body)
    if args.write:
        title = SECTION.replace("predicted", "predicted, every collective blocking") if args.blocking else SECTION
        benchlib.write_section(args.write, title, f".venv/bin/python {' '.join(sys.argv)}", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
