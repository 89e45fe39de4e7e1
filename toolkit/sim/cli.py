"""`python -m toolkit simulate`: one rank of a large cluster, its memory and bytes against the formulas.

    .venv/bin/python -m toolkit simulate --model gpt3-175b --strategy fsdp --world-size 512
    .venv/bin/python -m toolkit simulate --model gpt3-175b --strategy fsdp --world-size 512 \\
        --activation-checkpointing --forward-prefetch          # the FSDP paper's configuration
    .venv/bin/python -m toolkit simulate --model zero-7.5b --strategy zero2 --world-size 64 --layers 4
    .venv/bin/python -m toolkit simulate --model gpt3-175b --strategy fsdp --world-size 512 --tp 8 \\
        --activation-checkpointing --batch-per-rank 8   # torchtitan's 2D: tp inside each node, fsdp over dp = 64

Prints per-rank memory (model states, the peak and when it happens) and bytes per step next to
`toolkit.memory.formulas`, whether the peak fits in the cluster's GPU memory (and, if not, what would make
it fit), and, when it fits, the step's time, TFLOP/s per GPU and MFU on that cluster. Writes the Run
(`sim-<model>-<strategy>-<world>-run.json`), an HTML report and the modelled timeline (Chrome trace JSON,
for Perfetto) under `--out`.
"""
from __future__ import annotations

import argparse
import os

from ..models.presets import PRESETS
from ..parallel import STRATEGIES

HSDP = "hsdp"  # fsdp with hybrid sharding: shard inside groups of --sharding-group-size, replicate across them
FSDP_ONLY = ("forward_prefetch", "no_backward_prefetch", "sharding_group_size")


class _Defaults(argparse.HelpFormatter):
    """Each option's help ends with its default, where it has one worth saying (not None, not a switch's False)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is not None and action.default is not False and action.default != argparse.SUPPRESS \
                and "default" not in text:
            text += " (default: %(default)s)"
        return text


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m toolkit simulate", description=__doc__.splitlines()[0],
                                formatter_class=_Defaults)
    p.add_argument("--model", default="gpt3-175b", choices=sorted(PRESETS), help="a preset (toolkit.models.presets)")
    p.add_argument("--layers", type=int, default=None, help="number of layers (default: the preset's own depth)")
    p.add_argument("--strategy", default="fsdp", choices=sorted(STRATEGIES) + [HSDP],
                   help="how the data-parallel ranks share the model; hsdp: fsdp sharded inside each group of "
                        "--sharding-group-size ranks (a node by default), replicated across the groups")
    p.add_argument("--world-size", type=int, default=512, help="ranks (GPUs) in the simulated cluster, up to 4096")
    p.add_argument("--rank", type=int, default=0, help="the rank this process simulates")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="GPUs per node (NVLink inside, network between; default: the cluster's, 8 without one)")
    p.add_argument("--batch-per-rank", type=int, default=1,
                   help="sequences per data-parallel replica per step (a replica: one rank, or --tp ranks)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's context)")
    p.add_argument("--steps", type=int, default=1, help="measured steps, after one warm-up step")
    p.add_argument("--fp32", action="store_true", help="plain fp32 training (default: mixed precision, bf16)")
    p.add_argument("--sharding-group-size", type=int, default=None,
                   help="fsdp/hsdp: shard over groups of this many ranks (hsdp's default: --ranks-per-node)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks per model replica (consecutive ranks: inside a node when it divides "
                        "--ranks-per-node); --strategy is then the data-parallel method over world/tp replicas")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: split layer norms and residuals along the sequence (Korthikanti et al.)")
    p.add_argument("--cp", type=int, default=1,
                   help="context-parallel ranks per model replica: each holds --seq-len/cp tokens of every sequence, "
                        "attention by ring attention (zigzag-balanced); the data-parallel method then reduces over "
                        "dp x cp")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="keep each block's input only and recompute its activations in backward")
    p.add_argument("--forward-prefetch", action="store_true",
                   help="fsdp/hsdp: issue the next unit's all-gather before this unit's forward runs")
    p.add_argument("--no-backward-prefetch", action="store_true",
                   help="fsdp/hsdp: do not gather the next unit during backward (prefetching it is the default)")
    p.add_argument("--cluster", default="dgx-a100",
                   help="price the step and check the peak against the GPUs' memory on a cluster: dgx-a100, "
                        "dgx-h100 or this-machine (toolkit.sim.presets()); 'none' for memory and bytes only")
    p.add_argument("--mfu", type=float, default=None,
                   help="the achievable fraction of peak compute (default: the cluster preset's)")
    p.add_argument("--out", default="runs", help="folder for the Run, the HTML report and the modelled timeline")
    return p


def options_of(args, parse) -> tuple[str, dict]:
    """(the strategy to wrap with, its options) from the parsed flags; an fsdp-only flag elsewhere is an error."""
    strategy = "fsdp" if args.strategy == HSDP else args.strategy
    given = [f for f in FSDP_ONLY if getattr(args, f)]
    if strategy != "fsdp" and given:
        parse.error(f"--{given[0].replace('_', '-')} is an option of fsdp and hsdp, not of {args.strategy}")
    options = {} if args.fp32 else {"mixed_precision": True}
    group = args.sharding_group_size or ((args.ranks_per_node or 8) if args.strategy == HSDP else None)
    if group:
        options["sharding_group_size"] = group
    if args.activation_checkpointing:
        options["activation_checkpointing"] = True
    if args.tp != 1 or args.sequence_parallel:
        options["tp"] = args.tp
    if args.sequence_parallel:
        options["sequence_parallel"] = True
    if args.cp != 1:
        options["cp"] = args.cp
    if args.forward_prefetch:
        options["forward_prefetch"] = True
    if args.no_backward_prefetch:
        options["backward_prefetch"] = False
    return strategy, options


def main(argv=None) -> int:
    parse = parser()
    args = parse.parse_args(argv)
    strategy, options = options_of(args, parse)
    cluster = None if args.cluster.lower() == "none" else args.cluster
    from . import simulate

    build = PRESETS[args.model]
    model_fn = (lambda: build(n_layer=args.layers)) if args.layers else build
    try:
        sim = simulate(model_fn, strategy, args.world_size, rank=args.rank, ranks_per_node=args.ranks_per_node,
                       batch_per_rank=args.batch_per_rank, seq_len=args.seq_len, steps=args.steps,
                       cluster=cluster, mfu=args.mfu, **options)
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    print(sim.summary())
    if cluster:
        print(sim.cost.summary())
    os.makedirs(args.out, exist_ok=True)
    name = f"sim-{args.model}-{args.strategy}-{args.world_size}"
    sim.run.save(os.path.join(args.out, f"{name}-run.json"))
    report = write_report(sim, os.path.join(args.out, f"{name}-report.html"), title=f"{args.model}, {args.strategy}")
    print(f"run: {os.path.join(args.out, name + '-run.json')}\nreport: {report}")
    if cluster and sim.fits:  # the cost model's timeline, for Perfetto (none for a job that would not run)
        from ..trace.chrome import save_chrome

        trace = os.path.join(args.out, f"{name}-{cluster}-trace.json")
        save_chrome(sim.modelled_run, trace)
        print(f"modelled timeline (Perfetto): {trace}")
    return 0


def write_report(sim, path: str, title: str | None = None) -> str:
    """The summary, the verdict, memory at the peak (every category, against the GPU's memory and the formula),
    and, when priced and it fits, the step's cost and its modelled timeline."""
    from .. import viz
    from ..units import bytes_text

    t = sim.theory()
    rows = [{"category": k, "at the peak": bytes_text(v),
             "at the end of a step": bytes_text(sim.memory[k]) if k in sim.memory else "",
             "formula": bytes_text(t["model_states"][k]) if k in t["model_states"] else ""}
            for k, v in sim.peak_memory.items() if v or k in t["model_states"]]
    label = title or sim.strategy
    fit = sim.fit
    blocks = [viz.report.preformatted(sim.summary())]
    if fit is not None:
        blocks.append(viz.report.note(fit.text()))
    blocks += [viz.report.heading("Memory on the simulated rank"), viz.report.table(rows),
               viz.peak_bars({label: sim.peak_memory}, capacity=None if fit is None else fit.capacity,
                             device=None if fit is None else fit.device, predicted={label: t["model_states_total"]},
                             title=f"Memory at the peak: {label}, rank {sim.rank} of {sim.world_size}")]
    if fit is not None and fit.fits:
        blocks += [viz.report.heading(f"The step on {sim.cost.cluster.name}"), viz.report.preformatted(sim.cost.summary()),
                   viz.timeline(sim.modelled_run, title=f"modelled: rank {sim.rank} of {sim.world_size}, one step")]
    return viz.write_report(path, f"toolkit simulate: {label} on {sim.world_size} ranks", blocks,
                            subtitle="one rank of a simulated cluster: the strategies' own code on meta tensors")
