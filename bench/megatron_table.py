"""Megatron-LM's weak-scaling table (Narayanan et al., SC21, Table 1) predicted by the simulator from first principles.

For each row: the model the paper trained (vocabulary 51,200, sequence 2,048, tied embedding, the
attention kernels its code ran: `toolkit.models.as_in_papers`, "megatron"), every block recomputed in
backward, 16-bit mixed precision, data parallelism over what tensor and pipeline parallelism leave,
simulated for one rank on the fake process group and priced on the DGX A100 preset, whose numbers are
datasheets and a GEMM microbenchmark (`toolkit.sim.hardware`), none of them fitted to this table.

The paper's per-GPU TFLOP/s counts the recomputed forward, by its formula 96·B·s·l·h²·(1 + s/6h + V/16lh)
per step; the prediction divides that same count by the predicted step time and the GPUs, so the two
columns differ only by the step time (the simulated step executes exactly those FLOPs:
`tests/test_sim_kernels.py`). Layers are identical, so each row is simulated with two and three
layers per pipeline stage and extrapolated to its depth (`toolkit.sim.sweep.extrapolate`, exact for a
step's time up to its last bucket's overlap).

Rows 2-4 run tensor parallelism (`toolkit.parallel.wrap(..., tp=)`); rows 5-10 need pipeline
parallelism too (`pp=`): until wrap accepts it those rows say so and are skipped. A row whose simulated
peak does not fit in the GPU's memory (the paper ran it) says so instead of a prediction. The table gives
no micro-batch size: a row without pipelining runs its batch share in one pass, a pipelined one in
micro-batches of one sequence (an assumption, listed with the results).

    python bench/megatron_table.py [--rows 1,2] [--write docs/benchmarks.md]
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
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
FIELDS = ("params", "heads", "hidden", "layers", "tp", "pp", "gpus", "batch", "paper")
TOLERANCE = 0.15
MICRO_BATCH = 1  # sequences per micro-batch where pp > 1 (not in the table)


def row(i: int) -> dict:
    """Row i (1-based) of the table as a dict."""
    return dict(zip(FIELDS, TABLE[i - 1]), row=i)


def paper_flops(r: dict) -> float:
    """The paper's FLOPs per step (recomputation counted): 96 B s l h^2 (1 + s/6h + V/16lh)."""
    B, l, h = r["batch"], r["layers"], r["hidden"]
    return 96 * B * SEQ * l * h * h * (1 + SEQ / (6 * h) + VOCAB / (16 * l * h))


def model(n_layer: int, heads: int, hidden: int):
    from toolkit.models import tiny_gpt
    from toolkit.models.as_in_papers import as_in, recompute_blocks

    return recompute_blocks(as_in(tiny_gpt(vocab_size=VOCAB, seq_len=SEQ, n_layer=n_layer, n_head=heads,
                                           d_model=hidden), "megatron"))


def layout(r: dict) -> dict:
    """The options `toolkit.parallel.wrap` gets for the row's tensor and pipeline parallelism (none for row 1)."""
    if r["tp"] == 1 and r["pp"] == 1:
        return {}
    options = dict(tp=r["tp"], pp=r["pp"])
    if r["pp"] > 1:
        options.update(microbatches=r["batch"] // (r["gpus"] // (r["tp"] * r["pp"])) // MICRO_BATCH, schedule="1f1b")
    return options


def unsupported(r: dict) -> str | None:
    """Why the simulator cannot run this row's layout yet (None if it can): tries the layout on a tiny model."""
    options = layout(r)
    if not options:
        return None
    from toolkit.models import tiny_gpt
    from toolkit.sim import simulate

    world = r["tp"] * r["pp"]
    try:
        simulate(functools.partial(tiny_gpt, n_layer=2 * r["pp"], n_head=r["tp"], d_model=8 * r["tp"]), "ddp",
                 world, ranks_per_node=min(world, 8), warmup=False, progress=False, **options)
    except (TypeError, ValueError, NotImplementedError) as exc:
        text = str(exc)
        if not any(s in text for s in ("unknown option", "unexpected keyword", "not implemented")):
            raise  # the layout exists but fails: a defect to see, not a row to skip
        return (f"the simulator cannot run tp={r['tp']}, pp={r['pp']} yet (toolkit.parallel.wrap: "
                f"{type(exc).__name__}: {text.splitlines()[0][:140]})")
    return None


def predict(r: dict, cluster="dgx-a100") -> dict:
    """The row's step time on `cluster` (two and three layers per stage, extrapolated), and the paper's metric."""
    from toolkit.sim import simulate
    from toolkit.sim.sweep import BASE, extrapolate

    dp = r["gpus"] // (r["tp"] * r["pp"])
    per_rank = r["batch"] // dp
    start = time.process_time()
    sims = [simulate(functools.partial(model, n * r["pp"], r["heads"], r["hidden"]), "ddp", r["gpus"],
                     batch_per_rank=per_rank, mixed_precision=True, warmup=False, progress=False, cluster=cluster,
                     **layout(r)) for n in BASE]
    out = extrapolate(*sims, r["layers"] // r["pp"])
    if not out["fits"]:  # the paper ran it: the simulator's memory count disagrees, a defect to see
        from toolkit.units import bytes_text, memory_text

        return dict(r, skipped=f"does not fit in the simulator: peak {bytes_text(out['peak'])} on a GPU of "
                               f"{memory_text(out['fit'].capacity)} (the paper ran it: the simulated memory disagrees)")
    predicted = paper_flops(r) / out["step_time"] / r["gpus"] / 1e12
    return dict(r, step_time=out["step_time"], predicted=predicted, error=predicted / r["paper"] - 1,
                mfu=out["mfu"], hfu=out["hfu"], breakdown=out["breakdown"], cpu_s=time.process_time() - start,
                top=[(o["name"], o["seconds"]) for o in sims[-1].cost.per_op()[:4]])


def table(results: list) -> str:
    lines = ["| row | model | tp x pp x dp | batch | paper TFLOP/s | predicted | error | step (s) | exposed comm (s) | "
             "MFU / HFU |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        dp = r["gpus"] // (r["tp"] * r["pp"])
        if "skipped" in r:
            lines.append(f"| {r['row']} | {r['params']}B | {r['tp']} x {r['pp']} x {dp} | {r['batch']} | "
                         f"{r['paper']} | - | - | - | - | {r['skipped']} |")
            continue
        lines.append(f"| {r['row']} | {r['params']}B | {r['tp']} x {r['pp']} x {dp} | {r['batch']} | {r['paper']} | "
                     f"{r['predicted']:.0f} | {r['error']:+.0%} | {r['step_time']:.2f} | "
                     f"{max(r['breakdown']['exposed_comm'], 0.0):.3f} | {r['mfu']:.0%} / {r['hfu']:.0%} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(str(i) for i in range(1, len(TABLE) + 1)))
    parser.add_argument("--write", help="put the section into this markdown file")
    args = parser.parse_args(argv)
    results = []
    for i in (int(x) for x in args.rows.split(",") if x):
        r = row(i)
        why = unsupported(r)
        results.append(dict(r, skipped=why) if why else predict(r))
    body = table(results)
    done = [r for r in results if "skipped" not in r]
    within = sum(abs(r["error"]) <= TOLERANCE for r in done)
    body += (f"\n\n{within} of {len(done)} rows predicted within {TOLERANCE:.0%} "
             f"({len(results) - len(done)} not predicted: the reason is in the row). The slowest operations in each "
             "predicted row's deeper simulation: "
             + "; ".join(f"row {r['row']}: " + ", ".join(f"{n} {s:.2f} s" for n, s in r["top"]) for r in done) + "."
             "\n\nThe model is priced from datasheets and a GEMM microbenchmark only, so it predicts what the paper's "
             "kernels would take, not what its run paid besides; where it is above the paper, docs/differences.md "
             "('The simulator's cost model') lists what it leaves out. The table gives no micro-batch size: "
             f"a pipelined row is assumed to run micro-batches of {MICRO_BATCH} sequence(s).")
    print(body)
    if args.write:
        benchlib.write_section(args.write, SECTION, f"python {' '.join(sys.argv)}", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
