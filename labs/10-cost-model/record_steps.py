"""Instructor only (`python -m toolkit release` leaves it out: it runs the toolkit's own simulator and pricing).
Writes steps.json, the inputs lab 10 grades on: one training step of a small GPT per strategy, recorded from the
toolkit's own code on 8 simulated ranks (`toolkit.sim.simulate`), with every instruction's duration on one DGX
A100 node and the node's alpha and beta. It holds no expected value: the released checks judge properties, and
the hidden checks compute the exact values from the toolkit's cost model at grading time.

    python labs/10-cost-model/record_steps.py              # record the steps again, then their durations
    python labs/10-cost-model/record_steps.py --durations  # only the durations, for the stored programs

Run it again when a strategy changes the order of its collectives.
"""

import functools
import importlib.util
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from toolkit.models import tiny_gpt
from toolkit.sim import Collective, Compute, cluster_of, compute_time, simulate
from toolkit.sim.collective_time import collective_time

HERE = Path(__file__).resolve().parent
MODEL = dict(n_layer=4, d_model=256, n_head=4, vocab_size=512, seq_len=128)
STEPS = {  # name -> (strategy, options)
    "ddp": ("ddp", dict(bucket_cap_mb=1)),
    "zero1": ("zero1", {}),
    "zero3": ("zero3", {}),
    "zero3-buckets": ("zero3", dict(prefetch_bucket_size=800_000, reduce_bucket_size=800_000)),
    "fsdp": ("fsdp", dict(forward_prefetch=True, backward_prefetch=True)),
    "fsdp-no-prefetch": ("fsdp", dict(forward_prefetch=False, backward_prefetch=False)),
}
WORLD = 8


def _checks():
    spec = importlib.util.spec_from_file_location("_lab10_checks", HERE / "checks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def as_json(instruction) -> dict:
    kind = (
        "compute"
        if isinstance(instruction, Compute)
        else "collective"
        if isinstance(instruction, Collective)
        else "wait"
    )
    fields = {k: v for k, v in asdict(instruction).items() if k not in ("spans", "kernels")}
    if kind == "collective":
        fields["group"] = list(fields["group"])
        fields["args"] = {k: v for k, v in fields["args"].items() if isinstance(v, (int, float, str, list))}
    return dict(kind=kind, **fields)


def record() -> list:
    steps = []
    for name, (strategy, options) in STEPS.items():
        torch.manual_seed(0)
        sim = simulate(
            functools.partial(tiny_gpt, **MODEL),
            strategy,
            WORLD,
            batch_per_rank=4,
            mixed_precision=True,
            progress=False,
            **options,
        )
        steps.append(
            {
                "name": name,
                "strategy": strategy,
                "options": options,
                "world_size": WORLD,
                "program": [as_json(i) for i in sim.programs[-1]],
            }
        )
        print(f"{name}: {len(sim.programs[-1])} instructions")
    return steps


def durations_of(data: dict) -> dict:
    """Every recorded instruction's duration on one DGX A100 node (the A100 at its achievable rate, NVLink), and
    the node's alpha and beta: the inputs of the checks. No expected value: those are the hidden checks' to compute."""
    checks = _checks()
    node = cluster_of("dgx-a100")
    data = {
        "model": data["model"],
        "steps": [
            {k: step[k] for k in ("name", "strategy", "options", "world_size", "program")} for step in data["steps"]
        ],
    }
    for step in data["steps"]:
        program = checks.decode(step["program"])
        step["compute_s"] = [compute_time(i, node.gpu, "bf16") if isinstance(i, Compute) else None for i in program]
        step["comm_s"] = {
            str(i.id): collective_time(node, i.op, i.size_bytes, i.group, 0, i.args).seconds
            for i in program
            if isinstance(i, Collective)
        }
        step["alpha_beta"] = {"alpha": node.intra.latency, "beta": 1 / node.intra.bandwidth}
    return data


def main() -> None:
    path = HERE / "steps.json"
    data = json.loads(path.read_text()) if "--durations" in sys.argv else {"model": MODEL, "steps": record()}
    path.write_text(json.dumps(durations_of(data), indent=None) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
