"""A 128k-token context on 1,024 H100, every dp x pp x cp x tp layout priced; Llama 3's 128k layout held to its paper.

1. The sweep. A GPT the width of Llama 3 70B (h 8192, 64 query heads sharing 8 key-value heads as Llama's
   grouped-query attention does, 80 layers, its 128,256-token vocabulary; the MLP made as large as Llama's
   three-matrix one),
   sequences of 131,072 tokens, bf16, on 1,024 H100 (the "dgx-h100" preset). FSDP shards over dp x cp, tp 8 with
   sequence parallelism fills each node, cp and pp take the rest of a replica, dp what is left. A replica trains on
   one sequence a step without pp, on 2 pp micro-batches of one sequence with it (1F1B: a third of the step is
   the bubble); layouts are compared by their rate, tokens/s per GPU (and TFLOP/s in PaLM's count, below). Each
   layout: the toolkit's own code
   simulated for one rank at two depths, extrapolated to 80 layers (`toolkit.sim.sweep`), priced from published
   measurements of the hardware (`toolkit.sim.published`); a layout whose peak does not fit in 80 GB has no time.
2. Llama 3 405B's 128k stage (Dubey et al. 2024, "The Llama 3 Herd of Models", Table 4): 16,384 H100, tp 8, cp 16,
   pp 16, dp 8 ordered [tp, cp, pp, dp] from the innermost, 16 sequences of 131,072 tokens per replica (16M tokens),
   380 TFLOP/s per GPU (38% of bf16 peak). The stand-in: the toolkit's GPT at 405B's width (h 16384, 128 heads,
   vocabulary 128,256, Llama's grouped-query attention: 128 query heads sharing 8 key-value heads), its layer
   holding as many weights as Llama's (attention 2.125h^2 both; the GELU MLP's d_ff 4.875h = 79,872 where Llama's
   SwiGLU has 3 x 53,248: 9.75h^2 both), 8 layers on
   every one of the 16 stages (Llama's 126 put 7 on the first and the last, which also hold the embedding and the
   head: the step is set by the stages of 8 alike). The rate is the paper's convention (PaLM's MFU count, Chowdhery
   et al. 2022, appendix B: 6N + 12 L h s FLOPs a token, N = 405B, L = 126) over the predicted step. The paper
   does not say how many virtual stages its interleaved schedule ran: each is priced, none chosen to fit. Llama 3
   all-gathers the 8 key-value heads' K and V over cp; the toolkit's ring passes the same compact K and V (the same
   bytes, 2(cp-1)/cp of them, in cp-1 steps a layer beside compute), and Ulysses cannot run it (one key-value head
   per tensor-parallel rank does not split over cp 16): the ring is priced. FSDP as Llama 3's (not resharded after
   forward) and as FSDP runs on a GPU (the next unit gathered while this one computes: forward_prefetch);
   activation checkpointing, without which the stand-in's first stage does not fit. 1, 2, 4 and 8 virtual stages
   are priced (8: one layer each, as many as a stage of 8 layers can have).
3. What a larger world costs the simulation itself (`--part worlds`): one rank of a tp 8 x cp 16 x pp 2 layout of a
   small GPT, unpriced, at 4,096, 16,384 and 65,536 ranks, each in a fresh process: wall time and peak memory.

    .venv/bin/python bench/long_context.py [--part sweep|llama3|worlds|all] [--write docs/benchmarks.md]
    .venv/bin/python bench/long_context.py --part llama3 --virtual 8 --links-take-turns   (a what-if: links in turns)
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import benchlib  # bench/benchlib.py (a bench runs as a script: its folder is on sys.path)
from published_runs import GPU_FSDP

SECTIONS = {
    "sweep": "## A 128k context on 1,024 H100, every layout priced (bench/long_context.py)",
    "llama3": "## Llama 3 405B's 128k layout on 16,384 H100, predicted (bench/long_context.py)",
    "worlds": "## One simulated rank at 4,096 to 65,536 ranks (bench/long_context.py --part worlds)",
}
WORLDS = (4096, 16384, 65536)
S = 131072  # tokens per sequence
WORLD = 1024
LLAMA70 = dict(vocab_size=128256, seq_len=S, n_head=64, n_kv_head=8, d_model=8192, d_ff=28672 * 3 // 2)
LAYERS70 = 80
SWEEP = [(cp, pp) for pp in (1, 4, 8) for cp in (1, 2, 4, 8, 16, 32) if WORLD // (8 * cp * pp) >= 1]

# Llama 3 405B, Table 4's third row (and its model, Table 3)
LLAMA405 = dict(vocab_size=128256, seq_len=S, n_head=128, n_kv_head=8, d_model=16384, d_ff=79872)  # 11.875h^2 a layer
LLAMA3 = dict(world=16384, tp=8, cp=16, pp=16, dp=8, sequences=16, params=405e9, layers=126, measured=380.0)
VIRTUAL = (1, 2, 4, 8)  # the interleaved schedule's virtual stages per rank, not published: each priced (8: 1 layer)
ATTENTIONS = ("ring",)  # Ulysses cannot split 1 key-value head per tp rank over cp 16 (why Llama 3 all-gathers)
TOLERANCE = 0.15


def _sweep_row(cp: int, pp: int) -> dict:
    from toolkit.models import tiny_gpt
    from toolkit.sim.sweep import sweep

    dp = WORLD // (8 * cp * pp)
    per_replica = 1 if pp == 1 else 2 * pp  # one sequence a pass; under pp, 2 pp micro-batches of one sequence
    options = dict(tp=8, cp=cp, sequence_parallel=True)
    if pp > 1:
        options.update(pp=pp, microbatches=per_replica)
    (row,) = sweep(
        lambda n_layer: tiny_gpt(n_layer=n_layer, **LLAMA70),
        layers=LAYERS70,
        strategies={"fsdp": ("fsdp", options)},
        worlds=(WORLD,),
        cluster="dgx-h100",
        mixed_precision=True,
        seq_len=S,
        batch_per_rank=per_replica,
    )
    tokens = dp * per_replica * S
    rates = {}
    if row["step_time"]:
        per_token = 6 * row["num_params"] + 12 * LAYERS70 * LLAMA70["d_model"] * S  # PaLM's count (the module doc)
        rates = dict(
            tokens_per_gpu=tokens / WORLD / row["step_time"], palm=per_token * tokens / WORLD / row["step_time"]
        )
    return dict(row, cp=cp, pp=pp, dp=dp, sequences=per_replica, **rates)


def sweep_table(rows) -> str:
    lines = [
        "| tp x cp x pp x dp | sequences a replica | peak memory (80 GB) | step | tokens/s per GPU | "
        "TFLOP/s per GPU (PaLM's count) | attention | exposed comm | bubble |",
        "| --- " * 9 + "|",
    ]
    for r in rows:
        b = r["breakdown"]
        layout = f"8 x {r['cp']} x {r['pp']} x {r['dp']}"
        if not r["fits"]:
            lines.append(f"| {layout} | {r['sequences']} | {r['peak'] / 1e9:.0f} GB (over) | - | - | - | - | - | - |")
            continue
        lines.append(
            f"| {layout} | {r['sequences']} | {r['peak'] / 1e9:.0f} GB | {r['step_time']:.1f} s | "
            f"{r['tokens_per_gpu']:.0f} | {r['palm'] / 1e12:.0f} | {b['attention'] / b['step']:.0%} | "
            f"{b['exposed_comm'] / b['step']:.0%} | {b.get('bubble', 0.0) / b['step']:.0%} |"
        )
    return "\n".join(lines)


def llama3_flops_per_token() -> float:
    """PaLM's MFU count (Chowdhery et al. 2022, appendix B): 6N + 12 L h s (attention over the whole s, unmasked)."""
    return 6 * LLAMA3["params"] + 12 * LLAMA3["layers"] * LLAMA405["d_model"] * S


@functools.cache
def llama3(virtual: int, attention: str = "ring", share: bool = True) -> dict:
    """Llama 3 405B's 128k layout priced with `virtual` stages per rank (1: plain 1F1B) and cp's `attention`.
    FSDP as Llama 3's (section 3.3.2): units not resharded after forward (reshard_after_forward=False: under pp,
    gathered once a step); activation checkpointing, without which the stand-in's 16 micro-batches in flight on
    the first stage do not fit (the paper does not say what it recomputed)."""
    from toolkit.models import tiny_gpt
    from toolkit.sim import cluster_of
    from toolkit.sim.sweep import sweep

    c = LLAMA3
    options = dict(tp=c["tp"], cp=c["cp"], pp=c["pp"], order="tp-cp-pp-dp", sequence_parallel=True)
    options.update(microbatches=c["sequences"], cp_attention=attention, reshard_after_forward=False)
    options.update(GPU_FSDP)  # the next unit gathered while this one computes, as FSDP on a GPU does (published_runs)
    options.update(activation_checkpointing=True)
    if virtual > 1:
        options.update(schedule="interleaved", virtual_stages=virtual)
    (row,) = sweep(
        lambda n_layer: tiny_gpt(n_layer=n_layer, **LLAMA405),
        layers=8 * c["pp"],
        strategies={f"v{virtual} {attention}": ("fsdp", options)},
        worlds=(c["world"],),
        cluster=cluster_of("dgx-h100", links_share=share),
        mixed_precision=True,
        seq_len=S,
        batch_per_rank=c["sequences"],
    )
    tokens = c["dp"] * c["sequences"] * S
    rate = lambda seconds: llama3_flops_per_token() * tokens / c["world"] / seconds / 1e12  # noqa: E731
    step = row["step_time"]
    predicted = rate(step) if step else None
    return dict(
        row,
        virtual=virtual,
        attention=attention,
        predicted=predicted,
        error=None if predicted is None else predicted / c["measured"] - 1,
        band={end: rate(seconds) for end, seconds in row["band"].items() if seconds} if step else {},
    )


def llama3_table(results) -> str:
    lines = [
        "| cp's attention | schedule | peak memory (80 GB) | step | TFLOP/s per GPU, predicted (band) | published "
        "| error | attention | exposed comm | bubble |",
        "| --- " * 10 + "|",
    ]
    for r in results:
        b, name = r["breakdown"], "1F1B" if r["virtual"] == 1 else f"interleaved, {r['virtual']} virtual stages"
        if r["predicted"] is None:
            lines.append(
                f"| {r['attention']} | {name} | {r['peak'] / 1e9:.0f} GB (over) | - | - | {LLAMA3['measured']:g} "
                f"| - | - | - | - |"
            )
            continue
        lines.append(
            f"| {r['attention']} | {name} | {r['peak'] / 1e9:.0f} GB | {r['step_time']:.1f} s | {r['predicted']:.0f} "
            f"({r['band']['worst']:.0f}-{r['band']['best']:.0f}) | {LLAMA3['measured']:g} | {r['error']:+.0%} | "
            f"{b['attention'] / b['step']:.0%} | {b['exposed_comm'] / b['step']:.0%} | "
            f"{b.get('bubble', 0.0) / b['step']:.0%} |"
        )
    return "\n".join(lines)


def _sweep_text() -> str:
    rows = [_sweep_row(cp, pp) for cp, pp in SWEEP]
    fits = [r for r in rows if r["fits"]]
    text = (
        f"A GPT of Llama 3 70B's width (80 layers), sequences of {S:,} tokens, on {WORLD:,} H100 (tp 8 inside each "
        f"node; FSDP over dp x cp; a replica's step: one sequence, or under pp 2 pp micro-batches of one, 1F1B; cp's "
        f"attention: the ring). The rate in PaLM's count (6N + 12 L h s a token) for every layout alike: the "
        f"simulator's own FLOP count takes a zigzag ring's causal blocks at what they compute and a whole causal "
        f"attention at its unmasked FLOPs.\n\n" + sweep_table(rows)
    )
    if fits:
        best = max(fits, key=lambda r: r["tokens_per_gpu"])
        text += (
            f"\n\n{len(fits)} of {len(rows)} layouts fit; the fastest: tp 8 x cp {best['cp']} x pp {best['pp']} x dp "
            f"{best['dp']}, {best['tokens_per_gpu']:.0f} tokens/s per GPU."
        )
    return text


def _llama3_text(virtual=VIRTUAL, share: bool = True) -> str:
    results = [llama3(v, a, share) for a in ATTENTIONS for v in virtual]
    turns = "" if share else ", its links taking turns among the collectives on them (`links_share=False`)"
    return (
        "Llama 3 405B's 128k stage (Table 4: 16,384 H100, tp 8 x cp 16 x pp 16 x dp 8, 16M tokens a step, "
        f"380 TFLOP/s per GPU), its stand-in priced at 16,384 ranks{turns}:\n\n" + llama3_table(results)
    )


def _worlds_text() -> str:
    """Each world in a fresh process (its peak resident memory its own): the simulation's wall time and memory."""
    import subprocess

    script = (
        "import resource, sys, time; from toolkit.models import tiny_gpt; from toolkit.sim import simulate; "
        "t = time.perf_counter(); simulate(lambda: tiny_gpt(n_layer=2, d_model=256, n_head=8, seq_len=1024), "
        "'fsdp', int(sys.argv[1]), tp=8, cp=16, pp=2, microbatches=2, batch_per_rank=2, mixed_precision=True, "
        "progress=False); print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )
    lines = ["| ranks | simulation (s) | peak memory of the process (MB) |", "| --- | --- | --- |"]
    for world in WORLDS:
        out = subprocess.run([sys.executable, "-c", script, str(world)], capture_output=True, text=True, check=True)
        seconds, kilobytes = out.stdout.split()[-2:]
        lines.append(f"| {world:,} | {float(seconds):.1f} | {int(kilobytes) / 1e3:.0f} |")
    return (
        "One rank's program does not depend on the world, only on its groups; what grows is the DeviceMesh's groups "
        "(every group of every dimension, on every rank):\n\n" + "\n".join(lines)
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("sweep", "llama3", "worlds", "all"), default="all")
    parser.add_argument("--write", help="put each part's section into this markdown file")
    parser.add_argument("--virtual", default=",".join(map(str, VIRTUAL)), help="llama3: the virtual stages to price")
    parser.add_argument(
        "--links-take-turns",
        action="store_true",
        help="llama3: collectives on a link take turns rather than share it (a what-if: NCCL's communicators share)",
    )
    args = parser.parse_args(argv)
    try:
        virtual = tuple(int(v) for v in args.virtual.split(","))
    except ValueError:
        parser.error(f"--virtual takes virtual stages per rank separated by commas (e.g. 4,8), got {args.virtual!r}")
    if args.links_take_turns and args.write:
        parser.error("--links-take-turns is a what-if, not how the presets price: drop --write")
    started = time.perf_counter()
    llama3_part = functools.partial(_llama3_text, virtual, not args.links_take_turns)
    for part, make in (("sweep", _sweep_text), ("llama3", llama3_part), ("worlds", _worlds_text)):
        if args.part not in (part, "all"):
            continue
        text = make()
        text += f"\n\n({time.perf_counter() - started:.0f} s on this machine.)"
        started = time.perf_counter()
        print(text)
        if args.write:
            benchlib.write_section(args.write, SECTIONS[part], f".venv/bin/python {' '.join(sys.argv)}", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
