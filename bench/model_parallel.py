"""Model parallelism completed: what the Megatron-style changes save, measured at world 4 (gloo, CPU).

The measurements are tests/test_model_parallel.py's own (`tests/model_parallel_checks.py`, one launch of 4
ranks), so this table and the test that asserts it cannot drift apart. Each row: the quantity, what the toolkit
did before the change, and what it does now. "Before" is measured where the old way is still there to measure
(the embedding's forward: sequence parallelism all-reduced as plain tensor parallelism still does; FSDP's
default, which still gathers per micro-batch), else the old way's formula (its backward's all-gather of the
activation's gradient; the loss's two (N, V/t) fp32 buffers; each tp rank sending the whole activation).

    .venv/bin/python bench/model_parallel.py
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # the test's measurement functions

import model_parallel_checks as checks  # noqa: E402

import toolkit  # noqa: E402


def measure(directory: str) -> dict | None:
    import torch.distributed as dist

    found = {
        "embedding": checks.embedding_bytes(),
        "loss": checks.cross_entropy_backward_memory(),
        "sends": checks.pipeline_sends(),
        "fsdp": checks.fsdp_kept_gathered(),
    }
    return found if dist.get_rank() == 0 else None


def rows(found: dict) -> list[tuple]:
    t, m = 4, 4
    (plain_fw, _), (split_fw, split_bw) = found["embedding"][False], found["embedding"][True]  # before: SP all-reduced
    allocated, buffer = found["loss"]
    _, sends, gathers = found["sends"]
    per_micro, kept = found["fsdp"][False], found["fsdp"][True]
    units = kept[3]
    whole = sum(4 * padded for padded, _ in units)
    return [
        (
            f"embedding forward under sequence parallelism, tp {t} (b 8, s 32, h 32, fp32): bytes sent per rank",
            plain_fw,
            split_fw,
        ),
        (
            "  and its backward (the activation's gradient all-gathered; now also the positions')",
            (t - 1) / t * 8 * 32 * 32 * 4,
            split_bw,
        ),
        (
            "vocabulary-parallel loss backward, (256, 512) fp32 logits: bytes allocated at its peak (MemTracker)",
            2 * buffer,
            allocated,
        ),
        (
            "pipeline send bytes per tp rank, pp 2 x tp 2, m 4, one step (activations)",
            2 * sends["activation"],
            sends["activation"],
        ),
        ("  and the receiving stage's all-gather inside its tp group", 0, gathers),
        (
            f"fsdp x pp 2, m {m}: all-gather bytes per rank and step (reshard_after_forward=False keeps units)",
            per_micro[0],
            kept[0],
        ),
        ("  parameter bytes between a step's actions on this rank (the ledger)", per_micro[2][0], kept[2][0]),
        ("  of which the stage's units held whole", 0, whole),
    ]


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)  # --help; it takes no options
    with tempfile.TemporaryDirectory() as directory:
        found = toolkit.launch(measure, 4, args=(directory,), timeout_s=400, quiet=True)[0]
    print("| quantity | before | now |\n| --- | --- | --- |")
    for name, before, now in rows(found):
        print(f"| {name} | {before:,.0f} | {now:,.0f} |")


if __name__ == "__main__":
    main()
