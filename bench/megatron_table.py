"""Megatron-LM's weak-scaling table (Narayanan et al., SC21, Table 1) predicted by the simulator from first principles.

For each row: the model the paper trained (vocabulary 51,200, sequence 2,048, tied embedding, the
attention kernels its code ran: `toolkit.models.as_in_papers`, "megatron"), every block recomputed in
backward, 16-bit mixed precision, the layout, micro-batch size, data-parallel implementation and
pipeline schedule of the paper's own artifact (`examples/sc21/run_table_1.sh` in NVIDIA/Megatron-LM,
commit de7dc40, August 2021: `ARTIFACT` below), simulated on the fake process group and priced on the
DGX A100 preset, whose numbers are datasheets and a GEMM microbenchmark (`toolkit.sim.hardware`), none
of them fitted to this table: the kernels' and collectives' rates are published measurements of the hardware
(`toolkit.sim.published`: cuBLASLt's GEMM sweep, STREAM, nccl-tests, the network cards' rate in NCCL, compute beside
NCCL's kernels), and each prediction carries the band of their sources' spread.

The paper's per-GPU TFLOP/s counts the recomputed forward, by its formula 96·B·s·l·h²·(1 + s/6h + V/16lh)
per step; the prediction divides that same count by the predicted step time and the GPUs, so the two
columns differ only by the step time (the simulated step executes exactly those FLOPs:
`tests/test_sim_kernels.py`). Rows without pipelining are simulated with three and four layers and
extrapolated to their depth (`toolkit.sim.sweep.extrapolate`); pipelined rows run the pipeline's own
schedule on every kind of stage (`toolkit.sim.pipelined`) with one and two blocks per stage, extrapolated.
A row whose simulated peak does not fit in the GPU's memory says so in its memory column: the paper ran
every row, so the simulated memory disagrees (a defect to see); its step is priced all the same.

The optimizer is one fused AdamW kernel (`toolkit.sim.fused_adam`), as apex's FusedAdam that Megatron-LM
stepped with. The artifact's data parallelism: rows 1-4 ran torch's DDP (`--DDP-impl torch`: 25 MB buckets all-reduced
during backward, which the toolkit's "ddp" is), rows 5-10 Megatron's own ("local": one all-reduce of all
gradients once the pipeline's backward is over, nothing hidden: "ddp" with a single bucket). Row 4
accumulates 4 micro-batches of 8, and so does its simulation (`simulate(accumulation=4)`: Megatron's
forward_backward_no_pipelining runs all but the last inside torch DDP's no_sync).

The plain configuration (`--plain`) is what a student writes for the same rows: the toolkit's GPT as it comes
(FlashAttention through `scaled_dot_product_attention`, no dropout), `activation_checkpointing=True`, torch's AdamW,
the toolkit's DDP buckets, 1F1B with the artifact's micro-batch size, and one pass of a replica's sequences where
there is no pipeline. `--plain --kernels megatron` is that configuration with the paper's attention kernels put back
(`baddbmm`, the fused softmax, attention dropout, `bmm`), everything else the student's: how much of the plain rows'
distance from the paper their attention is.

    .venv/bin/python bench/megatron_table.py [--rows 1,2] [--plain [--kernels megatron]] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import benchlib  # bench/benchlib.py (a bench runs as a script: its folder is on sys.path)

SECTION = "## Megatron-LM's weak-scaling table, predicted (bench/megatron_table.py)"
VOCAB, SEQ = 51200, 2048
# params (B), heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s per GPU (Narayanan et al., SC21, Table 1)
TABLE = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
FIELDS = ("params", "heads", "hidden", "layers", "tp", "pp", "gpus", "batch", "paper")
# what the table leaves out, from the paper's artifact (examples/sc21/run_table_1.sh, NVIDIA/Megatron-LM de7dc40):
# micro-batch size, --DDP-impl, --num-layers-per-virtual-pipeline-stage (None: plain 1F1B); every row
# --activations-checkpoint-method uniform (each layer recomputed), --fp16, --clip-grad 1.0
ARTIFACT = [
    (16, "torch", None),
    (16, "torch", None),
    (16, "torch", None),
    (8, "torch", None),
    (4, "local", None),
    (2, "local", 5),
    (2, "local", 5),
    (1, "local", 3),
    (1, "local", 1),
    (1, "local", None),
]
TOLERANCE = 0.15


def row(i: int) -> dict:
    """Row i (1-based) of the table as a dict, with the artifact's micro-batch size, DDP and interleaving."""
    return configuration(dict(zip(FIELDS, TABLE[i - 1]), row=i), *ARTIFACT[i - 1])


def configuration(r: dict, micro_batch: int, ddp: str, per_virtual: int | None = None) -> dict:
    """A run as the artifact's scripts set it up: dp, micro-batches per replica, virtual stages per rank."""
    r = dict(r, micro_batch=micro_batch, ddp=ddp)
    r["dp"] = r["gpus"] // (r["tp"] * r["pp"])
    r["microbatches"] = r["batch"] // r["dp"] // micro_batch
    r["virtual_stages"] = r["layers"] // r["pp"] // per_virtual if per_virtual else 1
    return r


def figure_15(tp: int, batch: int = 32) -> dict:
    """Figure 15's runs (examples/sc21/run_figure_15.sh): a 5.9B GPT (hidden 3840, 32 heads, 32 layers) on 64
    GPUs as tp x dp, micro-batches of 1, Megatron's local DDP. The paper: the per-GPU rate falls as tp grows."""
    return configuration(
        dict(
            params=5.9,
            heads=32,
            hidden=3840,
            layers=32,
            tp=tp,
            pp=1,
            gpus=64,
            batch=batch,
            paper=None,
            row=f"fig15 tp={tp}",
        ),
        1,
        "local",
    )


def paper_flops(r: dict, recomputed: bool = True) -> float:
    """The paper's FLOPs per step, recomputation counted: 96 B s l h^2 (1 + s/6h + V/16lh) (its equation 3);
    without it (the model's FLOPs, for MFU): the layers' 72 B s l h^2 (1 + s/6h) and the head's 6 B s h V."""
    B, depth, h, vocab = r["batch"], r["layers"], r["hidden"], r.get("vocab", VOCAB)
    layers = (96 if recomputed else 72) * B * SEQ * depth * h * h * (1 + SEQ / (6 * h))
    return layers + 6 * B * SEQ * h * vocab


def model(
    n_layer: int,
    heads: int,
    hidden: int,
    plain: bool = False,
    vocab: int = VOCAB,
    kernels: str | None = None,
    whole_blocks: bool = True,
):
    """The row's GPT: as Megatron-LM's code ran it (its attention kernels, every block recomputed; without
    `whole_blocks`, none: the wrapper recomputes what the layout asks for), or (plain) the toolkit's GPT as it comes,
    to be checkpointed by the wrapper; plain with `kernels` ("megatron"), that GPT with the paper's attention kernels
    (`as_in_papers.as_in`)."""
    from toolkit.models import tiny_gpt
    from toolkit.models.as_in_papers import as_in, recompute_blocks

    gpt = tiny_gpt(vocab_size=vocab, seq_len=SEQ, n_layer=n_layer, n_head=heads, d_model=hidden)
    if plain:
        return gpt if kernels is None else as_in(gpt, kernels)
    return recompute_blocks(as_in(gpt, "megatron")) if whole_blocks else as_in(gpt, "megatron")


def figure_13(pp: int, batch: int = 128) -> dict:
    """Figure 13's runs (examples/sc21/run_figure_13.sh): a 162.2B GPT (hidden 20480, 128 heads, 32 layers) on
    64 GPUs as pp x tp (tp = 64 / pp), micro-batches of 1, local DDP. The paper: the best is tp = 8, pp = 8 (tp
    as wide as a node, the pipeline across nodes), at batch 32 and 128."""
    return configuration(
        dict(
            params=162.2,
            heads=128,
            hidden=20480,
            layers=32,
            tp=64 // pp,
            pp=pp,
            gpus=64,
            batch=batch,
            paper=None,
            row=f"fig13 pp={pp}",
        ),
        1,
        "local",
    )


def layout(r: dict, plain: bool = False) -> dict:
    """The options `toolkit.parallel.wrap` gets: the row's tensor and pipeline parallelism (none for row 1),
    its schedule, and its data parallelism: torch's DDP (25 MB buckets, the toolkit's default) or Megatron's
    local DDP (one all-reduce after backward: a bucket as large as the model). Plain: the toolkit's defaults
    (its DDP buckets, 1F1B) with activation checkpointing. Ranks in Megatron's order (tp innermost, pp outermost:
    the toolkit's default, and the artifact's)."""
    options = {} if r["ddp"] == "torch" or plain else dict(bucket_cap_mb=1e9)
    if plain:
        options["activation_checkpointing"] = True
    options.update(r.get("options", {}))  # a run's own (Korthikanti et al.'s: sequence parallelism, selective)
    if r["tp"] > 1:
        options["tp"] = r["tp"]
    if r["pp"] > 1:
        interleave = r["virtual_stages"] > 1 and not plain
        options.update(pp=r["pp"], microbatches=r["microbatches"], schedule="interleaved" if interleave else "1f1b")
        if interleave:
            options["virtual_stages"] = r["virtual_stages"]
    return options


def unsupported(r: dict) -> str | None:
    """Why the simulator cannot run this row's layout yet (None if it can): tries the layout on a tiny model."""
    options = layout(r)
    if "tp" not in options and "pp" not in options:
        return None
    from toolkit.models import tiny_gpt
    from toolkit.sim import simulate

    world = r["tp"] * r["pp"]
    try:
        tiny = dict(options, microbatches=r["pp"]) if r["pp"] > 1 else options
        simulate(
            functools.partial(tiny_gpt, n_layer=2 * r["pp"] * r["virtual_stages"], n_head=r["tp"], d_model=8 * r["tp"]),
            "ddp",
            world,
            ranks_per_node=min(world, 8),
            warmup=False,
            batch_per_rank=r["pp"],
            progress=False,
            **tiny,
        )
    except (TypeError, ValueError, NotImplementedError, ImportError) as exc:
        text = str(exc)
        if not any(s in text for s in ("unknown option", "unexpected keyword", "not implemented", "No module")):
            raise  # the layout exists but fails: a defect to see, not a row to skip
        return (
            f"the simulator cannot run tp={r['tp']}, pp={r['pp']} yet (toolkit.parallel.wrap: "
            f"{type(exc).__name__}: {text.splitlines()[0][:140]})"
        )
    return None


def predict(r: dict, cluster="dgx-a100", plain: bool = False, kernels: str | None = None) -> dict:
    """The row's steady step on `cluster`, the paper's metric (and its band, from the published measurements'
    spread), the memory verdict of the first stage (rank 0: the embedding, and under 1F1B the most micro-batches
    in flight). Without pipelining: three and four layers, extrapolated; with it, one and two blocks per (virtual)
    stage, or the whole model where a stage holds no more. The step is priced whether or not the peak fits (`fit`):
    the paper ran every row. plain: the configuration a student writes (the module doc)."""
    import torch

    from toolkit.sim import simulate
    from toolkit.sim.fused_adam import FusedAdamW
    from toolkit.sim.sweep import simulate_depths

    start = time.process_time()
    options = layout(r, plain)
    stages = r["pp"] * options.get("virtual_stages", 1)
    per_stage = r["layers"] // stages
    whole = "activation_checkpointing" not in options
    out, deepest = simulate_depths(
        lambda n: simulate(
            functools.partial(model, n * stages, r["heads"], r["hidden"], plain, kernels=kernels, whole_blocks=whole),
            "ddp",
            r["gpus"],
            optimizer=torch.optim.AdamW if plain else FusedAdamW,
            batch_per_rank=r["batch"] // r["dp"],
            accumulation=r["microbatches"] if r["pp"] == 1 and not plain else 1,
            mixed_precision=True,
            progress=False,
            cluster=cluster,
            **options,
        ),
        per_stage,
        pipelined=stages > 1,
    )
    b = out["breakdown"]
    predicted = paper_flops(r) / b["step"] / r["gpus"] / 1e12
    band = {end: paper_flops(r) / seconds / r["gpus"] / 1e12 for end, seconds in out["band"].items()}
    peak = deepest.cost.cluster.gpu.flops_per_s("bf16") * r["gpus"] * b["step"]
    return dict(
        r,
        step_time=b["step"],
        predicted=predicted,
        error=predicted / r["paper"] - 1 if r["paper"] else None,
        band=band,
        hfu=paper_flops(r) / peak,
        mfu=paper_flops(r, recomputed=False) / peak,
        breakdown=b,
        fit=out["fit"],
        cpu_s=time.process_time() - start,
        plain=plain,
        top=[(o["name"], o["seconds"]) for o in deepest.cost.per_op()[:4]],
        checked=out["checked"],
    )


def table(results: list) -> str:
    lines = [
        "| row | model | tp x pp x dp | micro-batch x count | DDP, schedule | paper TFLOP/s | predicted (band) | "
        "error | step (s) | GEMM | attention + memory-bound | exposed comm | bubble + p2p | MFU / HFU | "
        "peak memory |",
        "| --- " * 15 + "|",
    ]
    for r in results:
        options = layout(r, r.get("plain", False))
        schedule = (
            "-"
            if r["pp"] == 1
            else (f"interleaved v={options['virtual_stages']}" if "virtual_stages" in options else "1f1b")
        )
        cells = [
            r["row"],
            f"{r['params']}B",
            f"{r['tp']} x {r['pp']} x {r['dp']}",
            f"{r['micro_batch']} x {r['microbatches']}",
            f"{r['ddp']}, {schedule}",
            r["paper"],
        ]
        if "skipped" in r:
            cells += ["-"] * 8 + [r["skipped"]]
        else:
            fit, b, band = r["fit"], r["breakdown"], r["band"]
            share = {k: v / b["step"] for k, v in b.items()}
            cells += [
                f"{r['predicted']:.0f} ({band['worst']:.0f}-{band['best']:.0f})",
                f"{r['error']:+.0%}",
                f"{r['step_time']:.2f}",
                f"{share['gemm']:.0%}",
                f"{share['attention'] + share['memory_bound']:.0%}",
                f"{share['exposed_comm']:.0%}",
                f"{share.get('bubble', 0) + share.get('p2p', 0):.0%}",
                f"{r['mfu']:.0%} / {r['hfu']:.0%}",
                f"{fit.peak / 1e9:.0f} GB{'' if fit.fits else ' (over the 80 GB)'}",
            ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def trend(results: list) -> tuple[float, float]:
    """The paper's rate and the prediction's from the first to the last row predicted, as (paper, predicted) ratios
    of the mean of the last four rows to the mean of the first four (the paper: 1.16, rising with model size)."""
    done = [r for r in results if "skipped" not in r]
    if len(done) < 8:
        return float("nan"), float("nan")
    first, last = done[:4], done[-4:]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    return mean(last, "paper") / mean(first, "paper"), mean(last, "predicted") / mean(first, "predicted")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(str(i) for i in range(1, len(TABLE) + 1)))
    parser.add_argument("--plain", action="store_true", help="the configuration a student writes (the module doc)")
    parser.add_argument(
        "--kernels",
        choices=("megatron",),
        help="with --plain: the student's configuration with the attention kernels the paper's code ran",
    )
    parser.add_argument("--write", help="put the section into this markdown file")
    args = parser.parse_args(argv)
    if args.kernels and not args.plain:
        parser.error("--kernels goes with --plain: the artifact's configuration runs Megatron-LM's kernels already")
    results = []
    for i in (int(x) for x in args.rows.split(",") if x):
        r = row(i)
        why = unsupported(r)
        results.append(dict(r, skipped=why) if why else predict(r, plain=args.plain, kernels=args.kernels))
    body = table(results)
    done = [r for r in results if "skipped" not in r]
    within = sum(abs(r["error"]) <= TOLERANCE for r in done)
    paper, predicted = trend(results)
    body += (
        f"\n\n{within} of {len(done)} rows predicted within {TOLERANCE:.0%} "
        f"({len(results) - len(done)} not predicted: the reason is in the row)"
        + ("" if paper != paper else f"; rows 7-10 over rows 1-4: paper {paper:.2f}, predicted {predicted:.2f}")
        + ". The band: every published measurement at the worst and at the best end of its sources' spread "
        "(toolkit.sim.published). The slowest operations in each predicted row's deeper simulation: "
        + "; ".join(f"row {r['row']}: " + ", ".join(f"{n} {s:.2f} s" for n, s in r["top"]) for r in done)
        + "."
    )
    print(body)
    if args.write:
        title = SECTION if not args.plain else SECTION.replace("predicted", "predicted, plain configuration")
        if args.kernels:
            title = title.replace("plain configuration", "plain configuration with the paper's kernels")
        benchlib.write_section(args.write, title, f".venv/bin/python {' '.join(sys.argv)}", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
