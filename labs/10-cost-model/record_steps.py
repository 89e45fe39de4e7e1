"""Instructor only (`python -m toolkit release` leaves it out: it computes the answers). Writes steps.json:

- the steps lab 10 grades on: one training step of a small GPT per strategy, from the toolkit's own code on
  8 simulated ranks (`toolkit.sim.simulate`), with every instruction's duration on one DGX A100 node;
- every expected value the released checks compare with, from the toolkit's own cost model
  (`toolkit.memory.formulas.alpha_beta_time`, `toolkit.sim.timeline.schedule`), and what each classic
  mistake would give instead, so that the released checks hold numbers, never the answer's code.

    python labs/10-cost-model/record_steps.py              # record the steps again, then the expected values
    python labs/10-cost-model/record_steps.py --expected   # only the expected values, for the stored steps

Run it again when a strategy changes the order of its collectives, or when a case in checks.py changes.
"""
import functools
import importlib.util
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from toolkit.memory.formulas import alpha_beta_time
from toolkit.models import tiny_gpt
from toolkit.sim import Collective, Compute, Wait, cluster_of, compute_time, simulate
from toolkit.sim.collective_time import collective_time
from toolkit.sim.timeline import schedule

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
    kind = ("compute" if isinstance(instruction, Compute) else
            "collective" if isinstance(instruction, Collective) else "wait")
    fields = {k: v for k, v in asdict(instruction).items() if k not in ("spans", "kernels")}
    if kind == "collective":
        fields["group"] = list(fields["group"])
        fields["args"] = {k: v for k, v in fields["args"].items() if isinstance(v, (int, float, str, list))}
    return dict(kind=kind, **fields)


def record() -> list:
    steps = []
    for name, (strategy, options) in STEPS.items():
        torch.manual_seed(0)
        sim = simulate(functools.partial(tiny_gpt, **MODEL), strategy, WORLD, batch_per_rank=4,
                       mixed_precision=True, progress=False, **options)
        steps.append({"name": name, "strategy": strategy, "options": options, "world_size": WORLD,
                      "program": [as_json(i) for i in sim.programs[-1]]})
        print(f"{name}: {len(sim.programs[-1])} instructions")
    return steps


# --- the answers, and the classic mistakes ----------------------------------------------------------------
class _Cost:
    def __init__(self, seconds, resources=("link",)):
        self.seconds, self.resources = seconds, resources  # one communication stream, as in the lab


def replay(program, compute, comm, *, waits=True, tail=True, queue=True, blocking=False) -> dict:
    """The reference breakdown (the toolkit's schedule), or a classic mistake's step time."""
    if waits and tail and queue and not blocking:
        return schedule(program, compute, lambda c: _Cost(comm(c))).breakdown()
    if blocking:
        return {"step": sum(compute(i) for i in program if isinstance(i, Compute))
                + sum(comm(i) for i in program if isinstance(i, Collective))}
    kept = [i for i in program if waits or not isinstance(i, Wait)]
    timeline = schedule(kept, compute, lambda c: _Cost(comm(c), ("link",) if queue else ()))
    if tail:
        return {"step": timeline.step_time}
    return {"step": max([s.end for s in timeline.spans if s.kind == "compute"], default=0.0)}


MISTAKE_RULES = {"blocking": dict(blocking=True), "never_stalled": dict(waits=False),
                 "unwaited": dict(tail=False), "never_stalled_nor_waited_out": dict(waits=False, tail=False),
                 "no_queue": dict(queue=False)}


def step_values(program, compute, comm) -> dict:
    right = replay(program, compute, comm)
    wrong = {key: replay(program, compute, comm, **rule)["step"] for key, rule in MISTAKE_RULES.items()}
    both = "never_stalled_nor_waited_out"  # named only where neither mistake alone explains the number
    if any(abs(wrong[both] - wrong[one]) <= 1e-12 for one in ("never_stalled", "unwaited")):
        del wrong[both]
    return {"expected": right, "mistakes": {k: v for k, v in wrong.items() if abs(v - right["step"]) > 1e-12}}


def ring_values(op, size, n, alpha, beta) -> dict:
    chunk = size / n
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1
    wrong = {"half": (n - 1) * (alpha + chunk * beta), "latency_once": alpha + steps * chunk * beta,
             "whole_buffer": steps * (alpha + size * beta), "n_steps": (steps + (2 if op == "all_reduce" else 1))
             * (alpha + chunk * beta), "all_reduce": 2 * (n - 1) * (alpha + chunk * beta)}
    right = alpha_beta_time(op, size, n, alpha, beta)
    return {"expected": right, "mistakes": {k: v for k, v in wrong.items() if abs(v - right) > 1e-15 * max(right, 1)}}


def expected(data: dict) -> dict:
    checks = _checks()
    node = cluster_of("dgx-a100")
    alpha, beta = node.intra.latency, 1 / node.intra.bandwidth
    for step in data["steps"]:
        program = checks.decode(step["program"])
        step["compute_s"] = [compute_time(i, node.gpu, "bf16") if isinstance(i, Compute) else None for i in program]
        step["comm_s"] = {str(i.id): collective_time(node, i.op, i.size_bytes, i.group, 0, i.args).seconds
                          for i in program if isinstance(i, Collective)}
        compute = checks.durations(program, step["compute_s"], step["comm_s"])
        step.update(step_values(program, *compute))
        step["alpha_beta"] = {"alpha": alpha, "beta": beta, **replay(program, compute[0], lambda c: alpha_beta_time(
            c.op, c.size_bytes, len(c.group), alpha, beta))}
    data["hand"] = {}
    for name, case in checks.HAND.items():
        program = checks.decode(case["program"])
        data["hand"][name] = step_values(program, *checks.durations(program, case["compute_s"], case["comm_s"]))
    data["ring"] = {op: [ring_values(op, *case) for case in checks.RING_CASES]
                    for op in ("all_reduce", "reduce_scatter", "all_gather")}
    return data


def main() -> None:
    path = HERE / "steps.json"
    data = json.loads(path.read_text()) if "--expected" in sys.argv else {"model": MODEL, "steps": record()}
    path.write_text(json.dumps(expected(data), indent=None) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
