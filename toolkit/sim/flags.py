"""`python -m toolkit simulate`'s command line: its flags, and the translations between flags and Python's keywords.

`parser` declares the flags; `options_of` turns them into the strategy's keywords and `cluster_of_flag` --cluster
into a cluster; `in_flags` says advice and errors written for Python (`seq_len=1024`) in flags (`--seq-len 1024`).
"""

from __future__ import annotations

import argparse
import json
import os
import re

from ..cli_args import positive_int
from ..models.presets import PRESETS
from ..parallel import STRATEGIES
from ..parallel.checkpointing import ATTENTION, BY_OPERATION
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


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m toolkit simulate", description=description, formatter_class=_Defaults)
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
    p.add_argument(
        "--accumulation",
        type=positive_int,
        default=1,
        help="micro-batches a step's --batch-per-rank sequences are cut into, one optimizer step after them all "
        "(gradient accumulation: all but the last inside the strategy's no_sync())",
    )
    p.add_argument(
        "--reduce-every-micro-batch",
        action="store_true",
        help="with --accumulation: reduce every micro-batch's gradients, no no_sync() (Composer's FSDP does)",
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
        "--tp-comm-overlap",
        nargs="?",
        const=True,
        choices=("backward",),
        metavar="backward",
        help="with --sequence-parallel: its all-gathers and reduce-scatters as rings hidden behind the GEMMs, "
        "a chunk of the sequence at a time (Megatron-Core's --tp-comm-overlap); with backward, only the column "
        "layers' backward collectives beside the weights' gradients (Megatron-LM's before TransformerEngine)",
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
        nargs="?",
        const=1,
        type=checkpointing_flag,
        metavar="EVERY",
        help="keep each block's input only and recompute its activations in backward; with a number k, "
        "every k-th block only (2: half of them); with op, every block by operation (its matmuls' and "
        "attention's outputs kept, the rest recomputed: torchtitan's selective op checkpointing); with attention, "
        "only every block's core attention (Megatron's selective recomputation)",
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


def checkpointing_flag(text: str):
    """--activation-checkpointing's value: a whole number of 1 or more (every k-th block), op or attention."""
    if text in (BY_OPERATION, ATTENTION):
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be a whole number of 1 or more (every k-th block), {BY_OPERATION} (by operation) or {ATTENTION} "
            f"(the core attention), got {text!r}"
        ) from None


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
    if args.activation_checkpointing:  # 1 (the bare flag) is every block: True, as Python spells it
        k = args.activation_checkpointing
        options["activation_checkpointing"] = True if k == 1 else k
    if args.tp != 1 or args.sequence_parallel:
        options["tp"] = args.tp
    if args.sequence_parallel:
        options["sequence_parallel"] = True
    if args.tp_comm_overlap:
        options["tp_comm_overlap"] = args.tp_comm_overlap
    if args.cp != 1:
        options["cp"] = args.cp
    if args.ep is not None:
        if args.model not in MOE_PRESETS:
            parse.error(
                f"--ep splits the experts of an MoE model: --model {args.model} has none (use one of "
                f"{', '.join(MOE_PRESETS)})"
            )
        options["ep"] = args.ep
    if args.reduce_every_micro_batch and args.accumulation == 1:
        parse.error("--reduce-every-micro-batch is an option of gradient accumulation: add --accumulation 2 or more")
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
        ("no_sync=False", "--reduce-every-micro-batch"),
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
