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

import argparse
import json
import os
import re
import sys

from ..cli_args import positive_int
from ..models.presets import PRESETS, model_fn_for
from ..parallel import STRATEGIES
from ..parallel.pipeline.schedules import SCHEDULES

MOE_PRESETS = ("moe-gpt-s", "moe-gpt-64")  # the presets with MoE layers (toolkit.models.presets)
HSDP = "hsdp"  # fsdp with hybrid sharding: shard inside groups of --sharding-group-size, replicate across them
FSDP_ONLY = ("forward_prefetch", "no_backward_prefetch", "sharding_group_size")


class _Defaults(argparse.HelpFormatter):
    """Each option's help ends with its default, where it has one worth saying (not None, not a switch's False)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (
            action.default is not None
            and action.default is not False
            and action.default != argparse.SUPPRESS
            and "default" not in text
        ):
            text += " (default: %(default)s)"
        return text


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m toolkit simulate", description=__doc__.splitlines()[0], formatter_class=_Defaults
    )
    p.add_argument(
        "--model",
        default="gpt3-175b",
        help=f"a preset ({', '.join(sorted(PRESETS))}: toolkit.models.presets), or a Hugging Face "
        f"config.json (or its folder): the model transformers builds from it, nothing downloaded",
    )
    p.add_argument("--layers", type=int, default=None, help="number of layers (default: the model's own depth)")
    p.add_argument(
        "--strategy",
        default="fsdp",
        choices=sorted(STRATEGIES) + [HSDP],
        help="how the data-parallel ranks share the model; hsdp: fsdp sharded inside each group of "
        "--sharding-group-size ranks (a node by default), replicated across the groups",
    )
    p.add_argument(
        "--world-size", type=positive_int, default=512, help="ranks (GPUs) in the simulated cluster, up to 65536"
    )
    p.add_argument("--rank", type=int, default=0, help="the rank this process simulates")
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="GPUs per node (NVLink inside, network between; default: the cluster's, 8 without one)",
    )
    p.add_argument(
        "--batch-per-rank",
        type=positive_int,
        default=1,
        help="sequences per data-parallel replica per step (a replica: one rank, or --tp ranks)",
    )
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's context)")
    p.add_argument("--steps", type=positive_int, default=1, help="measured steps, after one warm-up step")
    p.add_argument("--fp32", action="store_true", help="plain fp32 training (default: mixed precision, bf16)")
    p.add_argument(
        "--sharding-group-size",
        type=int,
        default=None,
        help="fsdp/hsdp: shard over groups of this many ranks (hsdp's default: --ranks-per-node)",
    )
    p.add_argument(
        "--tp",
        type=positive_int,
        default=1,
        help="tensor-parallel ranks per model replica (consecutive ranks: inside a node when it divides "
        "--ranks-per-node); --strategy is then the data-parallel method over world/tp replicas",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tp: split layer norms and residuals along the sequence (Korthikanti et al.)",
    )
    p.add_argument(
        "--cp",
        type=positive_int,
        default=1,
        help="context-parallel ranks per model replica: each holds --seq-len/cp tokens of every sequence, "
        "attention by ring attention (zigzag-balanced); the data-parallel method then reduces over "
        "dp x cp",
    )
    p.add_argument(
        "--ep",
        type=positive_int,
        default=None,
        help=f"an MoE model's ({', '.join(MOE_PRESETS)}) experts split over groups of --ep ranks carved out of a "
        "pipeline stage's dp x cp x tp ranks as Megatron-core carves them, copied across the groups (default: "
        "the whole stage, one copy of each expert)",
    )
    p.add_argument(
        "--pp",
        type=positive_int,
        default=1,
        help="pipeline stages per model replica: the model's blocks cut into --pp stages (an embedding with "
        "the first, the head with the last); the step is --schedule over --microbatches",
    )
    p.add_argument(
        "--microbatches",
        type=positive_int,
        default=None,
        help="with --pp: micro-batches a replica's batch is cut into (it must divide --batch-per-rank; default: --pp)",
    )
    p.add_argument(
        "--schedule",
        default="1f1b",
        choices=sorted(SCHEDULES),
        help="with --pp: the pipeline's schedule (interleaved needs --virtual-stages 2 or more)",
    )
    p.add_argument(
        "--virtual-stages",
        type=positive_int,
        default=1,
        help="with --schedule interleaved: stages per rank (the blocks cut into --pp x this many stages)",
    )
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="keep each block's input only and recompute its activations in backward",
    )
    p.add_argument(
        "--forward-prefetch",
        action="store_true",
        help="fsdp/hsdp: issue the next unit's all-gather before this unit's forward runs",
    )
    p.add_argument(
        "--no-backward-prefetch",
        action="store_true",
        help="fsdp/hsdp: do not gather the next unit during backward (prefetching it is the default)",
    )
    p.add_argument(
        "--cluster",
        default="dgx-a100",
        help="price the step and check the peak against the GPUs' memory on a cluster: dgx-a100, "
        "dgx-h100 or this-machine (toolkit.sim.presets()), or a JSON file of your own cluster "
        '(fields as toolkit.sim.cluster_of\'s dict: {"name": "my-cluster", "gpu": '
        '"a100-80gb", "gpus_per_node": 8, "intra": ["300 GB/s", "3.4 us"], "inter": '
        '["200 Gb/s", "9.6 us"]}); \'none\' for memory and bytes only',
    )
    p.add_argument(
        "--mfu",
        type=float,
        default=None,
        help="the achievable fraction of peak compute (default: the cluster preset's)",
    )
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
    if args.ep is not None:
        if args.model not in MOE_PRESETS:
            parse.error(
                f"--ep splits the experts of an MoE model: --model {args.model} has none (use one of "
                f"{', '.join(MOE_PRESETS)})"
            )
        options["ep"] = args.ep
    pipeline = [f for f in ("microbatches", "virtual_stages") if getattr(args, f) not in (None, 1)]
    if args.pp == 1 and (pipeline or args.schedule != "1f1b"):
        parse.error(
            f"--{(pipeline or ['schedule'])[0].replace('_', '-')} is an option of a pipeline: add --pp 2 or more"
        )
    if args.pp > 1:
        options.update(pp=args.pp, microbatches=args.microbatches or args.pp, schedule=args.schedule)
        if args.virtual_stages != 1:
            options["virtual_stages"] = args.virtual_stages
    if args.forward_prefetch:
        options["forward_prefetch"] = True
    if args.no_backward_prefetch:
        options["backward_prefetch"] = False
    return strategy, options


def in_flags(text: str, parse: argparse.ArgumentParser) -> str:
    """`text` (advice or an error written for Python) in the command line's words: `activation_checkpointing=True`
    -> `--activation-checkpointing`, `seq_len=1024` -> `--seq-len 1024`, `schedule='1f1b'` -> `--schedule 1f1b`,
    a bare keyword (`sharding_group_size`) -> its flag; keywords the command line spells otherwise too."""
    for python, flag in (
        ("backward_prefetch=False", "--no-backward-prefetch"),
        ("mixed_precision=False", "--fp32"),
        ("mixed_precision=True", "(the default)"),
    ):
        text = text.replace(python, flag)
    for action in parse._actions:
        flags = [o for o in action.option_strings if o.startswith("--")]
        if not flags or action.dest == "help":
            continue
        key, flag = action.dest, flags[0]

        def spelled(m, flag=flag, switch=action.nargs == 0):
            return flag if switch or m.group(1) == "True" else f"{flag} {m.group(2)}"

        text = re.sub(rf"\b{key}=(True|['\"]?([^\s;,)'\"]+)['\"]?)", spelled, text)
        if "_" in key:  # a bare keyword of code (not "tp" or "model" in prose): a switch, or alone in brackets
            bare = rf"(?<![-\w.]){key}\b(?!\s*=)" if action.nargs == 0 else rf"(?<=\(){key}(?=\))"
            text = re.sub(bare, flag, text)
    return text


def summary(sim, parse) -> str:
    """`sim.summary()` with its verdict's advice in flags (the rest describes the run, in its own words)."""
    text = sim.summary()
    for line in sim.fit.text().splitlines() if sim.fit is not None else []:
        text = text.replace(line, in_flags(line, parse))
    return text


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_refusal(model_fn, tp: int, sequence_parallel: bool, seq_len: int) -> str | None:
    """Why the tensor-parallel code refuses to split `model_fn()` over `tp` ranks (its own checks: heads, the
    vocabulary, every split weight), or None: the model (one block is enough, its layers are alike) is wrapped
    on meta tensors by one rank of a fake world of `tp` ranks."""
    if sequence_parallel and seq_len % tp:
        return f"--sequence-parallel cuts the {seq_len} positions of a sequence over --tp ranks"
    from .. import parallel
    from .cluster import cluster
    from .simulate import build_on_meta

    with cluster(tp, 0):
        try:
            parallel.wrap(build_on_meta(model_fn), "local", tp=tp, sequence_parallel=sequence_parallel)
        except ValueError as exc:
            return str(exc)
    return None


def _seq_len(args, model_fn) -> int:
    """--seq-len, else the model's context (a toolkit GPT's seq_len, a Hugging Face config's positions)."""
    if args.seq_len:
        return args.seq_len
    import torch

    with torch.device("meta"):
        config = getattr(model_fn(), "config", None)
    return getattr(config, "seq_len", None) or getattr(config, "max_position_embeddings", None) or 1


def check_layout(args, model_fn, parse, one_block=None) -> None:
    """--tp, --cp, --pp, --virtual-stages and --microbatches against every constraint at once, before anything is
    simulated: a replica's pp x cp x tp ranks divide the world, the sequence splits into 2 x cp chunks (ring
    attention's zigzag), the tensor-parallel code splits the model over tp
    (`tp_refusal`), the blocks cut evenly into pp x virtual-stages stages, the micro-batches divide a replica's
    batch. A value that breaks one is answered with the values that keep all of them. `one_block`: the model
    with one block, for the tensor-parallel check (default: the whole model)."""
    tp, pp, cp, v, world = args.tp, args.pp, args.cp, args.virtual_stages, args.world_size
    if tp > 1:
        seq_len = _seq_len(args, model_fn)

        def tp_fits(t: int, p: int = pp) -> str | None:
            if world % (t * p * cp):
                return (
                    f"a replica's --pp {p} x --cp {cp} x --tp {t} ranks do not divide the {world} ranks"
                    if cp > 1
                    else f"a replica's --pp {p} x --tp {t} ranks do not divide the {world} ranks"
                )
            return tp_refusal(one_block or model_fn, t, args.sequence_parallel, seq_len) if t > 1 else None

        why = tp_fits(tp)
        if why:
            fits = [t for t in _divisors(world // (pp * cp) if world % (pp * cp) == 0 else world) if not tp_fits(t)]
            why = in_flags(why, parse).split(". ")[0].rstrip(".")  # its own suggestions knew one constraint only
            parse.error(f"--tp {tp} does not fit: {why}. Values that fit every constraint: {fits}.")
    if cp > 1:
        seq_len = _seq_len(args, model_fn)

        def cp_fits(c: int) -> bool:
            return world % (tp * pp * c) == 0 and seq_len % (2 * c) == 0

        if not cp_fits(cp):
            fits = [c for c in _divisors(world) if c > 1 and cp_fits(c)]
            parse.error(
                f"--cp {cp} does not fit: a replica's --pp {pp} x --cp x --tp {tp} ranks must divide the "
                f"{world} ranks, and the sequence of {seq_len} tokens must cut into 2 x --cp chunks (ring "
                f"attention's zigzag: rank i holds chunks i and 2cp-1-i). "
                + (
                    f"Values that fit every constraint: {fits}."
                    if fits
                    else f"No value does with --tp {tp} and --pp {pp}: change those, or --seq-len."
                )
            )
    if args.ep is not None and (world // pp) % args.ep:
        stage = world // pp
        fits = _divisors(stage)
        parse.error(
            f"--ep {args.ep} does not fit: the experts' groups are carved out of a pipeline stage's "
            f"{stage} ranks (--world-size {world} / --pp {pp}), so --ep must divide {stage}. "
            f"Values that fit every constraint: {fits}."
        )
    if pp > 1:
        import torch

        from ..parallel.pipeline.split import find_blocks

        with torch.device("meta"):
            blocks = len(find_blocks(model_fn())[1])

        def pp_fits(p: int) -> bool:
            return world % (tp * cp * p) == 0 and blocks % (p * v) == 0

        if not pp_fits(pp):
            fits = [p for p in _divisors(world) if p > 1 and pp_fits(p)]
            parse.error(
                f"--pp {pp} does not fit: a replica's --pp x --cp {cp} x --tp {tp} ranks must divide the "
                f"{world} ranks, "
                f"and the model's {blocks} blocks must cut evenly into --pp x --virtual-stages {v} stages. "
                + (
                    f"Values that fit every constraint: {fits}."
                    if fits
                    else f"No value does with --tp {tp} and --virtual-stages {v}: change those, or --layers."
                )
            )
    if pp > 1:
        if args.schedule == "interleaved" and v < 2:
            parse.error("--schedule interleaved runs several stages per rank: add --virtual-stages 2 or more")
        if args.schedule != "interleaved" and v != 1:
            parse.error(
                f"--virtual-stages {v} needs --schedule interleaved (--schedule {args.schedule} runs one "
                f"stage per rank)"
            )
        m = args.microbatches or pp
        if args.batch_per_rank % m:
            parse.error(
                f"--microbatches {m}{'' if args.microbatches else ' (the default: --pp)'} does not divide "
                f"--batch-per-rank {args.batch_per_rank} (a replica's sequences per step): use --microbatches "
                f"one of {_divisors(args.batch_per_rank)}, or --batch-per-rank a multiple of {m} (e.g. "
                f"{m * max(1, -(-args.batch_per_rank // m))})."
            )


def cluster_of_flag(value: str, parse):
    """--cluster: None ('none'), a preset's name, or the dict of a JSON file (a user-defined cluster)."""
    if value.lower() == "none":
        return None
    if value.endswith(".json") or os.path.sep in value:
        try:
            with open(value) as f:
                found = json.load(f)
        except (OSError, ValueError) as exc:
            parse.error(f"--cluster {value}: could not read a cluster from it ({exc})")
        if not isinstance(found, dict):
            parse.error(f"--cluster {value}: the file holds a {type(found).__name__}, not a cluster's fields")
        for link in ("intra", "inter"):  # JSON has lists where toolkit.sim.cluster_of takes (bandwidth, latency)
            if isinstance(found.get(link), list):
                found[link] = tuple(found[link])
        return found
    return value


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
        if action.nargs == 0:
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
