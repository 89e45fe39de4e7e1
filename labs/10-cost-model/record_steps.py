"""Record the steps lab 10 grades on: one training step of a small GPT per strategy, from the toolkit's own
code on 8 simulated ranks (`toolkit.sim.simulate`), written to steps.json next to this file.

    python labs/10-cost-model/record_steps.py

Run it again when a strategy changes the order of its collectives; the checks read only steps.json.
"""
import functools
import json
from dataclasses import asdict
from pathlib import Path

import torch

from toolkit.models import tiny_gpt
from toolkit.sim import Collective, Compute, simulate

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


def as_json(instruction) -> dict:
    kind = "compute" if isinstance(instruction, Compute) else "collective" if isinstance(instruction, Collective) else "wait"
    fields = asdict(instruction)
    if kind == "collective":
        fields["group"] = list(fields["group"])
        fields["args"] = {k: v for k, v in fields["args"].items() if isinstance(v, (int, float, str, list))}
    return dict(kind=kind, **fields)


def main() -> None:
    steps = []
    for name, (strategy, options) in STEPS.items():
        torch.manual_seed(0)
        sim = simulate(functools.partial(tiny_gpt, **MODEL), strategy, WORLD, batch_per_rank=4,
                       mixed_precision=True, progress=False, **options)
        steps.append({"name": name, "strategy": strategy, "options": options, "world_size": WORLD,
                      "program": [as_json(i) for i in sim.programs[-1]]})
        print(f"{name}: {len(sim.programs[-1])} instructions")
    path = Path(__file__).resolve().parent / "steps.json"
    path.write_text(json.dumps({"model": MODEL, "steps": steps}, indent=None) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
