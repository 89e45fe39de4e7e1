"""The toolkit's MoE layer next to DeepSpeed's (`deepspeed.moe.layer.MoE`), same configuration, one run.

Both layers are built on every rank of one job (gloo on the CPU, expert parallel over all ranks) with
the same shape: d_model, d_ff, E experts (E/W per rank), top-2, capacity factor, tokens per rank, and the
same weights (the toolkit's experts and router are copied into DeepSpeed's). A no-drop pass first checks
that the two compute the same function (DeepSpeed renormalises the gate weights *after* dropping, the
toolkit before, so they differ only where choices are dropped). Then forward + backward of each layer are
timed, interleaved (A, B, B, A, ...) so machine noise hits both alike, each time the slowest rank's,
median over repetitions; the ratio toolkit / DeepSpeed is the headline.

From the toolkit's own trace of the timed passes: the share of the layer's time each rank spent inside
its all-to-alls (counts, dispatch, combine and both backward ones; waiting for the other rank included),
and the bytes one dispatch sent: the toolkit sends only kept rows, DeepSpeed its padded (E, C, d) buffer.

DeepSpeed is an optional dependency (`pip install -e .[bench]`, or `pip install deepspeed` with
DS_BUILD_OPS=0). Without it, or if its layer cannot run here, the bench says why and still measures
the toolkit's layer.

    python bench/moe.py [--world-size 2] [--repeats 15] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import traceback

import benchlib  # bench/benchlib.py (a bench runs as a script: its folder is on sys.path)
import torch
import torch.distributed as dist

import toolkit

CONFIGS = {  # name -> d_model, d_ff, experts per rank, tokens per rank; top-2, capacity factor 1.25
    "small": dict(d=64, ff=256, per_rank=2, tokens=512),
    "medium": dict(d=256, ff=1024, per_rank=2, tokens=2048),
    "many experts": dict(d=128, ff=512, per_rank=8, tokens=1024),
}
TOP_K, FACTOR = 2, 1.25
SECTION = "## MoE layer: toolkit vs DeepSpeed (bench/moe.py)"


# --- DeepSpeed, if it is there -------------------------------------------------------------------------
def deepspeed_status() -> str:
    """ "" when deepspeed imports, else why not (checked in the launcher, before any rank starts)."""
    try:
        import deepspeed  # noqa: F401
        from deepspeed.moe.layer import MoE  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any reason is a reason to skip, and to say so
        return f"deepspeed is not usable here ({type(exc).__name__}: {exc}); install it with `pip install -e .[bench]`"
    return ""


def _deepspeed_layer(mine, world: int):
    """DeepSpeed's MoE with the shape and the weights of the toolkit's layer `mine` (this rank's experts)."""
    import deepspeed.comm as dscomm
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    if not dscomm.is_initialized():
        dscomm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    d, ff = mine.d_model, mine.d_ff
    expert = torch.nn.Sequential(torch.nn.Linear(d, ff), torch.nn.GELU(), torch.nn.Linear(ff, d))
    layer = DeepSpeedMoE(
        d,
        expert,
        num_experts=mine.num_experts,
        ep_size=world,
        k=mine.top_k,
        capacity_factor=mine.gate.capacity_factor,
        eval_capacity_factor=mine.gate.capacity_factor,
        min_capacity=1,
        use_rts=False,
        top2_2nd_expert_sampling=False,
    )
    layer.set_deepspeed_parallelism()
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(mine.gate.router.weight)
        for e, ffn in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            ffn[0].weight.copy_(mine.experts.w1[e].t())
            ffn[0].bias.copy_(mine.experts.b1[e])
            ffn[2].weight.copy_(mine.experts.w2[e].t())
            ffn[2].bias.copy_(mine.experts.b2[e])
    return layer


# --- on every rank -------------------------------------------------------------------------------------
def _toolkit_layer(cfg, world, factor):
    from toolkit.moe import MoE

    E = cfg["per_rank"] * world
    return MoE(cfg["d"], cfg["ff"], E, top_k=TOP_K, capacity_factor=factor, seed=0, init_std=0.05, name="bench")


def _pass(layer, x) -> float:
    """Forward + backward of one layer on this rank's tokens; the seconds it took here."""
    layer.zero_grad(set_to_none=True)
    x.grad = None
    start = time.perf_counter()
    out = layer(x)
    out, aux = out[0], out[1]
    (out.square().mean() + 0.01 * aux).backward()
    return time.perf_counter() - start


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # raw: bookkeeping, not part of any layer's trace
    return t.item()


def _agreement(cfg, world):
    """Max |toolkit - DeepSpeed| of outputs and input gradients with capacity for every choice."""
    E = cfg["per_rank"] * world
    mine = _toolkit_layer(cfg, world, float(E))
    theirs = _deepspeed_layer(mine, world)
    x = torch.randn(cfg["tokens"], cfg["d"], generator=torch.Generator().manual_seed(dist.get_rank()))
    outs, grads = [], []
    for layer in (mine, theirs):
        xi = x.clone().requires_grad_(True)
        out = layer(xi)[0]
        out.square().mean().backward()
        outs.append(out.detach())
        grads.append(xi.grad)
    diffs = torch.tensor([(outs[0] - outs[1]).abs().max().item(), (grads[0] - grads[1]).abs().max().item()])
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    return diffs.tolist()


def _share(events, rank):
    """Per timed pass on this rank: (share of its time inside all-to-alls, seconds by role)."""
    shares, roles = [], {}
    for span in (e for e in events if e["name"] == "bench/toolkit"):
        inside = [
            e
            for e in events
            if e["cat"] == "comm" and e["name"] == "all_to_all" and span["start"] <= e["start"] <= span["end"]
        ]
        total = span["end"] - span["start"]
        shares.append(sum(e["end"] - e["start"] for e in inside) / total)
        for e in inside:
            roles.setdefault(e["args"].get("moe", "?"), []).append((e["end"] - e["start"]) / total)
    return statistics.median(shares), {k: statistics.median(v) for k, v in roles.items()}


def bench(configs, repeats: int, warmup: int, deepspeed_reason: str):
    from toolkit.moe import capacity
    from toolkit.run import Run
    from toolkit.trace import recorder, span

    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for name in configs:
        cfg = CONFIGS[name]
        E = cfg["per_rank"] * world
        row = {"config": name, **cfg, "experts": E, "world": world, "deepspeed": deepspeed_reason}
        mine = _toolkit_layer(cfg, world, FACTOR)
        theirs = None
        if not deepspeed_reason:
            try:
                row["agreement"] = _agreement(cfg, world)
                theirs = _deepspeed_layer(mine, world)
            except Exception as exc:  # noqa: BLE001 - say exactly why, then measure the toolkit alone
                row["deepspeed"] = deepspeed_reason = (
                    f"DeepSpeed's MoE layer failed on CPU/gloo: {type(exc).__name__}: {exc} "
                    f"(at {traceback.extract_tb(exc.__traceback__)[-1].filename.split('site-packages/')[-1]}:"
                    f"{traceback.extract_tb(exc.__traceback__)[-1].lineno})"
                )
        x = torch.randn(cfg["tokens"], cfg["d"], generator=torch.Generator().manual_seed(rank)).requires_grad_(True)
        sides = {"toolkit": mine, "deepspeed": theirs} if theirs is not None else {"toolkit": mine}
        times = {side: [] for side in sides}
        recorder.reset()
        for i in range(warmup + repeats):
            order = list(sides) if i % 2 == 0 else list(reversed(sides))
            for side in order:
                dist.barrier()
                recorder.enabled = side == "toolkit" and i >= warmup  # the trace of the timed passes only
                with span("bench/toolkit") if recorder.enabled else _nothing():
                    seconds = _pass(sides[side], x)
                recorder.enabled = True
                seconds = _slowest(seconds)
                if i >= warmup:
                    times[side].append(seconds)
        run = Run.capture({"bench": name}, align=False)
        share, roles = _share(run.events, rank)
        dispatch = [e for e in run.events if e["args"].get("moe") == "dispatch"]
        C = capacity(cfg["tokens"], E, TOP_K, FACTOR)  # DeepSpeed's is the same: ceil(k * f * T / E)
        row.update(
            toolkit_s=statistics.median(times["toolkit"]),
            share=share,
            roles=roles,
            toolkit_dispatch_bytes=statistics.median(e["args"]["bytes_sent"] for e in dispatch),
            deepspeed_dispatch_bytes=(world - 1) / world * E * C * cfg["d"] * 4,
        )
        if theirs is not None:
            row["deepspeed_s"] = statistics.median(times["deepspeed"])
        shares = [None] * world
        dist.all_gather_object(shares, (share, roles))
        row["share_by_rank"] = shares
        rows.append(row)
    return rows


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# --- the report ----------------------------------------------------------------------------------------
def table(rows) -> str:
    world = rows[0]["world"]
    reason = next((r["deepspeed"] for r in rows if r["deepspeed"]), "")
    try:
        import deepspeed

        version = f"DeepSpeed {deepspeed.__version__}"
    except Exception:  # noqa: BLE001
        version = "DeepSpeed not installed"
    lines = [
        f"World size {world}, gloo on CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"shared), torch {torch.__version__}, {version}. Top-{TOP_K}, capacity factor {FACTOR}, fp32, "
        f"E/W experts per rank; forward + backward of one layer, the slowest rank's time, median.",
        "",
    ]
    if reason:
        lines += [f"**DeepSpeed not measured:** {reason}", ""]
    lines += [
        "| config | d_model | d_ff | experts | tokens/rank | toolkit (ms) | DeepSpeed (ms) | toolkit/DeepSpeed "
        "| all-to-all share of toolkit layer (rank 0 / rank 1) | dispatch bytes sent: toolkit / DeepSpeed | "
        "max diff, no drops (out / grad) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        ds, agree = r.get("deepspeed_s"), r.get("agreement")
        shares = " / ".join(f"{s:.0%}" for s, _ in r["share_by_rank"][:2])
        ds_ms = f"{ds * 1e3:.1f}" if ds else "-"
        ratio = f"{r['toolkit_s'] / ds:.2f}" if ds else "-"
        diff = f"{agree[0]:.1e} / {agree[1]:.1e}" if agree else "-"
        lines.append(
            f"| {r['config']} | {r['d']} | {r['ff']} | {r['experts']} | {r['tokens']} | {r['toolkit_s'] * 1e3:.1f} | "
            f"{ds_ms} | {ratio} | {shares} | {r['toolkit_dispatch_bytes'] / 1e3:.0f} KB / "
            f"{r['deepspeed_dispatch_bytes'] / 1e3:.0f} KB | {diff} |"
        )
    roles = rows[-1]["share_by_rank"][0][1]
    lines += [
        "",
        "All-to-all share by role on rank 0 ("
        + rows[-1]["config"]
        + "): "
        + ", ".join(f"{k} {v:.1%}" for k, v in roles.items())
        + ".",
        "",
        "How to read it: the all-to-all share is the time a rank spent inside its all-to-all calls, "
        "waiting for the other rank included (its experts still computing, or more tokens routed to it), "
        "so on shared cores it measures skew as much as bytes; small layers are latency-bound (five "
        "collective rounds per pass), large ones compute-bound. DeepSpeed pads every expert's buffer to "
        "the capacity C and sends all E·C rows; the toolkit exchanges counts first and sends only the kept "
        "rows. The max diff column runs both layers with the same weights and room for every choice: "
        "they compute the same function (with drops they differ by design: DeepSpeed renormalises the "
        "two gate weights after dropping, the toolkit before). Times on this shared 2-core machine move "
        "by tens of percent from run to run; compare the ratio, measured side by side, not the ms.",
    ]
    return "\n".join(lines)


def write_section(path: str, body: str) -> None:
    """This bench's section of ``path`` (``benchlib.write_section``)."""
    benchlib.write_section(path, SECTION, f"python {' '.join(sys.argv)}", body)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--write", help="put the table into this markdown file (its own section)")
    args = parser.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}; choose from {sorted(CONFIGS)}")
    reason = deepspeed_status()
    if reason:
        print(f"note: {reason}; measuring the toolkit's layer alone.", file=sys.stderr)
    rows = toolkit.launch(
        bench, args.world_size, args=(configs, args.repeats, args.warmup, reason), timeout_s=300, quiet=True
    )[0]
    text = table(rows)
    print(text)
    if args.write:
        write_section(args.write, text)
        print(f"written to {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
