"""`python -m toolkit simulate`: one rank of a large cluster, its memory and bytes against the formulas.

    python -m toolkit simulate --model gpt3-175b --strategy fsdp --world-size 512
    python -m toolkit simulate --model zero-7.5b --strategy zero2 --world-size 64 --layers 4

Prints per-rank memory (model states, the peak and when it happens) and bytes per step next to
`toolkit.memory.formulas`, and writes the Run (`sim-<model>-<strategy>-<world>-run.json`) and an HTML
report under `--out` (default `runs/`).
"""
from __future__ import annotations

import argparse
import os

from ..models.presets import PRESETS
from ..parallel import STRATEGIES


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m toolkit simulate", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt3-175b", choices=sorted(PRESETS), help="a preset (toolkit.models.presets)")
    p.add_argument("--layers", type=int, default=None, help="override the preset's number of layers")
    p.add_argument("--strategy", default="fsdp", choices=sorted(STRATEGIES))
    p.add_argument("--world-size", type=int, default=512)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--batch-per-rank", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=None, help="default: the model's context length")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--fp32", action="store_true", help="plain fp32 training (default: mixed precision, bf16)")
    p.add_argument("--sharding-group-size", type=int, default=None, help="fsdp: hybrid sharding over groups of F")
    p.add_argument("--out", default="runs", help="folder for the Run and the HTML report")
    p.add_argument("--cluster", default=None, help="price the step on a cluster (toolkit.sim.presets(): dgx-a100, "
                                                   "dgx-h100, this-machine): step time, TFLOP/s, MFU, a modelled timeline")
    p.add_argument("--mfu", type=float, default=None, help="with --cluster: the achievable fraction of peak")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    from . import simulate

    build = PRESETS[args.model]
    model_fn = (lambda: build(n_layer=args.layers)) if args.layers else build
    options = {} if args.fp32 else {"mixed_precision": True}
    if args.sharding_group_size:
        options["sharding_group_size"] = args.sharding_group_size
    try:
        sim = simulate(model_fn, args.strategy, args.world_size, rank=args.rank, ranks_per_node=args.ranks_per_node,
                       batch_per_rank=args.batch_per_rank, seq_len=args.seq_len, steps=args.steps,
                       cluster=args.cluster, mfu=args.mfu, **options)
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    print(sim.summary())
    os.makedirs(args.out, exist_ok=True)
    name = f"sim-{args.model}-{args.strategy}-{args.world_size}"
    sim.run.save(os.path.join(args.out, f"{name}-run.json"))
    report = write_report(sim, os.path.join(args.out, f"{name}-report.html"))
    print(f"run: {os.path.join(args.out, name + '-run.json')}\nreport: {report}")
    if args.cluster:  # the cost model's answer, and its timeline for Perfetto
        from ..trace.chrome import save_chrome
        print(sim.cost.summary())
        save_chrome(sim.modelled_run, os.path.join(args.out, f"{name}-{args.cluster}-trace.json"))
        print(f"modelled timeline (Perfetto): {os.path.join(args.out, f'{name}-{args.cluster}-trace.json')}")
    return 0


def write_report(sim, path: str) -> str:
    """The summary, the memory bars (simulated peak by category against the formula) and the collectives."""
    from .. import viz

    t = sim.theory()
    rows = [{"category": k, "at the end of a step (GB)": f"{sim.memory[k] / 1e9:.3f}",
             "formula (GB)": f"{t['model_states'][k] / 1e9:.3f}",
             "at the peak (GB)": f"{sim.peak_memory.get(k, 0) / 1e9:.3f}"} for k in ("params", "grads", "optimizer")]
    rows += [{"category": k, "at the end of a step (GB)": "", "formula (GB)": "",
              "at the peak (GB)": f"{v / 1e9:.3f}"} for k, v in sim.peak_memory.items() if k not in rows[0] and
             k not in ("params", "grads", "optimizer")]
    blocks = [viz.report.preformatted(sim.summary()), viz.report.heading("Memory on the simulated rank"),
              viz.report.table(rows),
              viz.memory_bars({sim.strategy: sim.run}, {sim.strategy: t["model_states_total"]}, unit=1e9,
                              title="Simulated peak per category (bars) and the formula's model states (diamond)")]
    return viz.write_report(path, f"toolkit simulate: {sim.strategy} on {sim.world_size} ranks", blocks,
                            subtitle="one rank of a simulated cluster: the strategies' own code on meta tensors")
