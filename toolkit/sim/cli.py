"""`python -m toolkit simulate`: one rank of a large cluster, its memory and bytes against the formulas.

    .venv/bin/python -m toolkit simulate --model gpt3-175b --strategy fsdp --world-size 512
    .venv/bin/python -m toolkit simulate --model gpt3-175b --strategy fsdp --world-size 512 \\
        --activation-checkpointing --forward-prefetch          # the FSDP paper's configuration
    .venv/bin/python -m toolkit simulate --model zero-7.5b --strategy zero2 --world-size 64 --layers 4
    .venv/bin/python -m toolkit simulate --model gpt3-175b --strategy fsdp --world-size 512 --tp 8 \\
        --activation-checkpointing --batch-per-rank 8   # torchtitan's 2D: tp inside each node, fsdp over dp = 64
    .venv/bin/python -m toolkit simulate --model gpt3-175b --strategy zero1 --world-size 1024 --tp 8 --pp 8 \\
        --microbatches 16 --batch-per-rank 16 --activation-checkpointing   # Megatron-LM's 3D layout
    .venv/bin/python -m toolkit simulate --model gpt3-175b --cluster my-cluster.json   # a cluster of your own

Prints per-rank memory (model states, the peak and when it happens) and bytes per step next to
`toolkit.memory.formulas`, whether the peak fits in the cluster's GPU memory (and, if not, what would make
it fit), and, when it fits, the step's time, TFLOP/s per GPU and MFU on that cluster. Writes the Run
(`sim-<model>-<strategy>-<world>[-<every flag not at its default>]-run.json`: another configuration, other
files), an HTML report and the modelled timeline (Chrome trace JSON, for Perfetto) under `--out`. What it
advises and every error are said in flags, not in Python's keywords.
"""

from __future__ import annotations

import os
import re
import sys

from ..models.presets import PRESETS, model_fn_for
from . import flags
from .flags import MOE_PRESETS, cluster_of_flag, in_flags, options_of
from .layout_check import check_layout

__all__ = ["PRESETS", "check_layout", "main", "options_of", "parser", "write_report"]


def parser():
    """The command line's parser (`toolkit.sim.flags`), described by this module's first line."""
    return flags.parser(__doc__.splitlines()[0])


def summary(sim, parse) -> str:
    """`sim.summary()` with its verdict's advice in flags (the rest describes the run, in its own words)."""
    text = sim.summary()
    for line in sim.fit.text().splitlines() if sim.fit is not None else []:
        text = text.replace(line, in_flags(line, parse))
    return text


def model_name(model: str) -> str:
    """--model as a name: the preset's, or a Hugging Face config's file or folder name."""
    return model if model in PRESETS else os.path.basename(os.path.normpath(model)).removesuffix(".json")


def file_name(args, parse) -> str:
    """sim-<model>-<strategy>-<world>, then each flag not at its default (another configuration, other files)."""
    parts = [f"sim-{model_name(args.model)}-{args.strategy}-{args.world_size}"]
    for action in parse._actions:
        if action.dest in ("help", "model", "strategy", "world_size", "out") or not action.option_strings:
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        flag = action.option_strings[-1].lstrip("-")
        if action.nargs == 0 or (action.const is not None and value == action.const):  # a switch, given bare
            parts.append(flag)
        else:
            text = os.path.splitext(os.path.basename(str(value)))[0] if action.dest == "cluster" else str(value)
            text = re.sub(r"[^A-Za-z0-9.]+", "-", text)
            parts.append(f"{flag}{text}" if isinstance(value, (int, float)) else f"{flag}-{text}")
    return "-".join(parts)


def experts_over_their_group(model_fn, args):
    """An MoE preset built, inside the simulation, over this rank's expert-parallel group: --ep ranks (by default a
    pipeline stage's) carved as `toolkit.parallel.mesh.expert_group` carves them, which is what `moe_model_fn` does
    for `train` and what a pipeline or an ep layout checks the model for."""

    def build():
        from ..parallel.mesh import expert_group

        ep = args.ep or args.world_size // args.pp
        return model_fn(group=expert_group(ep, tp=args.tp, pp=args.pp, cp=args.cp))

    return build


def main(argv=None) -> int:
    parse = parser()
    args = parse.parse_args(argv)
    strategy, options = options_of(args, parse)
    cluster = cluster_of_flag(args.cluster, parse)
    try:
        model_fn = model_fn_for(args.model, args.layers)
    except ValueError as exc:
        parse.error(str(exc))
    check_layout(args, model_fn, parse, one_block=model_fn_for(args.model, 1))
    if args.model in MOE_PRESETS:
        model_fn = experts_over_their_group(model_fn, args)
    from . import simulate

    try:
        sim = simulate(
            model_fn,
            strategy,
            args.world_size,
            rank=args.rank,
            ranks_per_node=args.ranks_per_node,
            batch_per_rank=args.batch_per_rank,
            accumulation=args.accumulation,
            no_sync=not args.reduce_every_micro_batch,
            seq_len=args.seq_len,
            steps=args.steps,
            cluster=cluster,
            mfu=args.mfu,
            **options,
        )
    except ValueError as exc:
        print(f"error: {in_flags(str(exc), parse)}", file=sys.stderr)
        return 2
    print(summary(sim, parse))
    if cluster and sim.fits:  # the verdict is in the summary: the step's cost without it
        print(sim.cost.summary().replace(f"; {sim.fit.text()}", ""))
    os.makedirs(args.out, exist_ok=True)
    name = os.path.join(args.out, file_name(args, parse))
    sim.run.save(f"{name}-run.json")
    report = write_report(sim, f"{name}-report.html", title=f"{model_name(args.model)}, {args.strategy}", parse=parse)
    print(f"run: {name}-run.json\nreport: {report}")
    if cluster and sim.fits:  # the cost model's timeline, for Perfetto (none for a job that would not run)
        from ..trace.chrome import save_chrome

        save_chrome(sim.modelled_run, f"{name}-trace.json")
        print(f"modelled timeline (Perfetto): {name}-trace.json")
    return 0


def write_report(sim, path: str, title: str | None = None, parse=None) -> str:
    """The summary, the verdict, memory at the peak (every category, against the GPU's memory and the formula),
    and, when priced and it fits, the step's cost and its modelled timeline."""
    from .. import viz
    from ..units import bytes_text

    t = sim.theory()
    rows = [
        {
            "category": k,
            "at the peak": bytes_text(v),
            "at the end of a step": bytes_text(sim.memory[k]) if k in sim.memory else "",
            "formula": bytes_text(t["model_states"][k]) if k in t["model_states"] else "",
        }
        for k, v in sim.peak_memory.items()
        if v or k in t["model_states"]
    ]
    label = title or sim.strategy
    fit = sim.fit
    blocks = [viz.report.preformatted(summary(sim, parse) if parse is not None else sim.summary())]
    blocks += [
        viz.report.heading("Memory on the simulated rank"),
        viz.report.table(rows),
        viz.peak_bars(
            {label: sim.peak_memory},
            capacity=None if fit is None else fit.capacity,
            device=None if fit is None else fit.device,
            predicted={label: t["model_states_total"]},
            title=f"Memory at the peak: {label}, rank {sim.rank} of {sim.world_size}",
        ),
    ]
    if fit is not None and fit.fits:
        cost = sim.cost.summary().replace(f"; {fit.text()}", "")  # the verdict is in the summary above
        blocks += [
            viz.report.heading(f"The step on {sim.cost.cluster.name}"),
            viz.report.preformatted(cost),
            viz.timeline(sim.modelled_run, title=f"modelled: rank {sim.rank} of {sim.world_size}, one step"),
        ]
    return viz.write_report(
        path,
        f"toolkit simulate: {label} on {sim.world_size} ranks",
        blocks,
        subtitle="one rank of a simulated cluster: the strategies' own code on meta tensors",
    )
