"""The toolkit's tensor parallelism next to PyTorch's own (`parallelize_module`, ColwiseParallel/RowwiseParallel).

Same model (the tiny GPT, untied head), same seed, same batches, world 2, gloo, dp = 1 x tp = 2; the steps are
interleaved (A, B, A, B, ...) so machine noise hits both alike. Plans, identical on both sides:

    mlp     every block's MLP: fc column-parallel, proj row-parallel (attention, norms, embeddings replicated)
    vocab   + the token embedding split by vocabulary, the head column-parallel with its logits gathered
            (torch: RowwiseParallel(input_layouts=Replicate()) / ColwiseParallel(output_layouts=Replicate()))

(torch's plan cannot split the toolkit GPT's fused QKV by heads without changing the model's forward, so
attention stays whole on both sides; the toolkit's own default plan, heads and the vocabulary-parallel loss
included, is a third row with no torch counterpart.) Reported per plan: median step time per side (the
slowest rank's), the ratio toolkit/torch, bytes each rank sends per step (ours from the door's trace; torch's
from its functional collectives, with the same ring accounting), and the largest loss difference.

    python bench/tensor_parallel.py [--steps 10] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import platform
import statistics
import sys
import time

import benchlib  # bench/benchlib.py
import torch
import torch.distributed as dist

import toolkit
from toolkit.models import SyntheticCorpus, tiny_gpt

MODEL = dict(n_layer=4, d_model=128, n_head=4, vocab_size=256, seq_len=64, tied_head=False)
BATCH, LR = 8, 1e-3
PLANS = {
    "mlp": {"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"},
    "vocab": {"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise", "tok_emb": "vocab", "head": "vocab"},
}


def _model():
    torch.manual_seed(0)
    return tiny_gpt(**MODEL)


def _torch_tp(plan_name: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = {f"blocks.{i}.mlp.fc": ColwiseParallel() for i in range(MODEL["n_layer"])}
    plan.update({f"blocks.{i}.mlp.proj": RowwiseParallel() for i in range(MODEL["n_layer"])})
    if plan_name == "vocab":
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate())
        plan["head"] = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(model, mesh, plan)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)


class _FunctionalBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes a rank sends in torch's functional collectives (DTensor's), ring accounting as the door's."""

    def __init__(self):
        super().__init__()
        self.sent = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
            n = dist.get_world_size()
            size = args[0].numel() * args[0].element_size()
            self.sent += {
                "all_reduce": 2 * (n - 1) * size // n,
                "all_gather_into_tensor": (n - 1) * size,
                "reduce_scatter_tensor": (n - 1) * size // n,
            }[name]
        return func(*args, **(kwargs or {}))


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # raw: bookkeeping, not part of either step
    return t.item()


def compare(plan_name: str, steps: int) -> dict:
    from toolkit.trace.analysis import bytes_per_step
    from toolkit.trace.events import recorder

    corpus = SyntheticCorpus(MODEL["vocab_size"], MODEL["seq_len"])
    opt_ours = functools.partial(torch.optim.AdamW, lr=LR, foreach=False)
    plan = {"tp_plan": PLANS[plan_name]} if plan_name in PLANS else {}
    ours, ours_opt = toolkit.parallel.wrap(_model(), "local", optimizer=opt_ours, tp=2, **plan)
    theirs, theirs_opt = (None, None) if plan_name not in PLANS else _torch_tp(plan_name)
    times, losses, torch_bytes = {"toolkit": [], "torch": []}, {"toolkit": [], "torch": []}, 0
    recorder.reset()
    for step in range(steps):
        x, y = corpus.batch(step, BATCH)
        for side, model, opt in (("toolkit", ours, ours_opt), ("torch", theirs, theirs_opt)):
            if model is None:
                continue
            counter = _FunctionalBytes() if side == "torch" else None
            dist.barrier()
            t0 = time.perf_counter()
            spans = _spans if side == "toolkit" else _no_spans  # the trace's step windows: ours only
            with counter if counter is not None else contextlib.nullcontext():
                with spans("forward", step):
                    loss = model(x, y)
                with spans("backward", step):
                    loss.backward()
                with spans("optimizer", step):
                    opt.step()
                    opt.zero_grad()
            times[side].append(_slowest(time.perf_counter() - t0))
            losses[side].append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
            if counter is not None:
                torch_bytes = counter.sent
    run = toolkit.Run.capture({})
    ours_bytes = bytes_per_step(run, dist.get_rank())[-1]["total"]
    keep = slice(2, None)  # the first steps warm up (allocator, optimizer states)
    out = {"toolkit": statistics.median(times["toolkit"][keep]), "toolkit_bytes": ours_bytes}
    if theirs is not None:
        out.update(
            torch=statistics.median(times["torch"][keep]),
            torch_bytes=torch_bytes,
            loss_diff=max(abs(a - b) for a, b in zip(losses["toolkit"], losses["torch"])),
        )
    return out


def _spans(name: str, step: int):
    from toolkit.trace.events import span

    return span(name, step=step) if name == "optimizer" else span(name, step=step, micro=0)


def _no_spans(name: str, step: int):
    return contextlib.nullcontext()


def run_all(steps: int) -> dict:
    return {name: compare(name, steps) for name in ("mlp", "vocab", "default plan")}


def table(results: dict) -> str:
    rows = [
        "| plan | toolkit step (ms) | torch step (ms) | ratio toolkit/torch | toolkit bytes/step/rank | torch "
        "bytes/step/rank | largest loss difference |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        if "torch" in r:
            rows.append(
                f"| {name} | {r['toolkit'] * 1e3:.1f} | {r['torch'] * 1e3:.1f} | {r['toolkit'] / r['torch']:.2f} "
                f"| {r['toolkit_bytes']:,} | {r['torch_bytes']:,} | {r['loss_diff']:.1e} |"
            )
        else:
            rows.append(
                f"| {name} (heads, vocabulary-parallel loss) | {r['toolkit'] * 1e3:.1f} | - | - | "
                f"{r['toolkit_bytes']:,} | - | - |"
            )
    return "\n".join(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--write", default=None, help="put the table into this markdown file (docs/benchmarks.md)")
    args = parser.parse_args(argv)
    results = toolkit.launch(run_all, 2, args=(args.steps,), timeout_s=900)[0]
    text = table(results)
    print(text)
    if args.write:
        command = "python bench/tensor_parallel.py" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
        body = (
            f"World size 2 (dp 1 x tp 2), gloo on CPU ({platform.machine()}, shared machine), torch "
            f"{torch.__version__}; tiny GPT {MODEL}, {BATCH} sequences per step, AdamW, fp32; median of the "
            f"last {args.steps - 2} interleaved steps, the slowest rank's.\n\n{text}"
        )
        benchlib.write_section(
            args.write, "## Tensor parallelism against torch's (bench/tensor_parallel.py)", command, body
        )


if __name__ == "__main__":
    main()
