"""The toolkit's ring attention next to torch's context parallelism (torch.distributed.tensor.experimental).

torch's `context_parallel(mesh, buffers=...)` does not run on this machine: inside it, F.scaled_dot_product_attention
takes DTensors, and on a CPU the kernel it dispatches to, `aten._scaled_dot_product_flash_attention_for_cpu`, has
no sharding strategy (torch 2.13: "NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu
.default does not have a sharding strategy registered"; its ring handles only the CUDA kernels: flash, efficient,
cuDNN). `check_torch_context_parallel` below tries it and reports what it raised. So what can be compared is the
attention function alone: torch's own ring, `_templated_ring_attention` and `_templated_ring_attention_backward`
(what `context_parallel` calls for each CUDA kernel), given the same CPU kernel as the toolkit's ring, on the same
zigzag shards (torch's head-tail load balancer gives rank i chunks i and 2cp-1-i too), forward and backward.
torch passes K and V either by one all-gather (its default, "allgather": Llama 3's choice) or around the ring by
all-to-all ("alltoall"); the gradient of K and V always goes round the ring. Both rows are measured.

Reported per sequence length: the median time of one forward + backward per side (the slowest rank's), the ratio
toolkit/torch, the bytes each rank sends (ours from the door's trace; torch's from its functional collectives,
with the same ring accounting) and the largest difference between the two sides' outputs and gradients.

    python bench/context_parallel.py [--repeats 7] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import benchlib  # bench/benchlib.py
import torch
import torch.distributed as dist

import toolkit

HEADS, HEAD_DIM, BATCH = 8, 64, 1
LENGTHS = (1024, 4096)  # whole sequences; each rank holds half


def check_torch_context_parallel() -> str:
    """What torch's context_parallel does here: 'runs', or the error it raised."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    except Exception as exc:  # noqa: BLE001 - what it raised is the finding
        cause = exc.__context__ if isinstance(exc.__context__, NotImplementedError) else exc
        return f"{type(cause).__name__}: {str(cause).splitlines()[0]}"
    return "runs"


class _FunctionalBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes a rank sends in torch's functional collectives: an all-gather (n-1)/n of its output, an all-to-all
    (torch's ring permutes K and V with one) the rows it sends to the other ranks."""

    def __init__(self):
        super().__init__()
        self.sent = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        n, me = dist.get_world_size(), dist.get_rank()
        if name == "all_gather_into_tensor":
            self.sent += (n - 1) * args[0].numel() * args[0].element_size()
        elif name == "all_to_all_single":
            tensor, splits = args[0], args[2]  # (input, output_split_sizes, input_split_sizes, group)
            row = tensor.numel() // max(tensor.shape[0], 1) * tensor.element_size()
            self.sent += sum(rows for j, rows in enumerate(splits) if j != me) * row
        return func(*args, **(kwargs or {}))


def _torch_ring(q, k, v, method: str):
    """torch's ring attention (forward and backward templates) over the world, on the CPU's fused kernel."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    from toolkit.parallel.context.block import fused_attend, fused_attend_backward  # the toolkit's: the same kernel

    group = dist.group.WORLD

    def forward(query, key, value, is_causal, **kwargs):
        return fused_attend(query, key, value, is_causal, None)

    def backward(grad_out, query, key, value, out, logsumexp, is_causal, **kwargs):
        return fused_attend_backward(grad_out, query, key, value, out, logsumexp, is_causal, None)

    class Ring(torch.autograd.Function):
        @staticmethod
        def forward(ctx, query, key, value):
            out, lse = cp._templated_ring_attention(group, 2, forward, query, key, value, is_causal=True)
            ctx.save_for_backward(query, key, value, out, lse)
            return out

        @staticmethod
        def backward(ctx, grad):
            query, key, value, out, lse = ctx.saved_tensors
            return cp._templated_ring_attention_backward(
                group, 2, backward, grad.contiguous(), "grad_out", query, key, value, out, lse, is_causal=True
            )[:3]

    cp._cp_options.enable_load_balance = True
    cp._cp_options.rotate_method = cp._RotateMethod.ALL_GATHER if method == "allgather" else cp._RotateMethod.ALL_TO_ALL
    return Ring.apply(q, k, v)


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # raw: bookkeeping, not part of either side
    return t.item()


def compare(length: int, repeats: int) -> dict:
    from toolkit.parallel.context import Ring, SequenceSplit, ring_attention

    ring = Ring(None)
    split = SequenceSplit(ring.size, ring.rank)
    torch.manual_seed(0)
    whole = [torch.randn(BATCH, HEADS, length, HEAD_DIM) for _ in range(4)]
    q, k, v, grad = (split.local(t, dim=2).contiguous() for t in whole)
    sides = {
        "toolkit": lambda a, b, c: ring_attention(a, b, c, ring, split),
        "torch allgather": lambda a, b, c: _torch_ring(a, b, c, "allgather"),
        "torch alltoall": lambda a, b, c: _torch_ring(a, b, c, "alltoall"),
    }
    times = {name: [] for name in sides}
    sent, results = {}, {}
    for _ in range(repeats):
        for name, attend in sides.items():  # interleaved: machine noise hits every side alike
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            counted = []
            counter = (
                _FunctionalBytes()
                if name != "toolkit"
                else toolkit.comm.listening(
                    lambda kind, event, tensor, counted=counted: (
                        counted.append(event["args"]["bytes_sent"]) if kind == "issue" else None
                    )
                )
            )
            dist.barrier()
            t0 = time.perf_counter()
            with counter:
                out = attend(*inputs)
                out.backward(grad)
            times[name].append(_slowest(time.perf_counter() - t0))
            sent[name] = sum(counted) if name == "toolkit" else counter.sent
            results[name] = [out.detach()] + [t.grad for t in inputs]
    keep = slice(1, None)  # the first repeat warms up
    out = {name: {"seconds": statistics.median(times[name][keep]), "bytes": sent[name]} for name in sides}
    for name in sides:
        out[name]["difference"] = max((a - b).abs().max().item() for a, b in zip(results[name], results["toolkit"]))
    return out


def run_all(repeats: int, lengths=LENGTHS) -> dict:
    return {
        "torch context_parallel": check_torch_context_parallel(),
        **{length: compare(length, repeats) for length in lengths},
    }


def table(results: dict, lengths=LENGTHS) -> str:
    rows = [
        "| sequence | toolkit fwd+bwd (ms) | torch allgather (ms) | torch alltoall (ms) | ratio toolkit/allgather | "
        "ratio toolkit/alltoall | toolkit bytes/rank | torch allgather bytes/rank | torch alltoall bytes/rank | "
        "largest difference |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for length in lengths:
        r = results[length]
        ms = {name: r[name]["seconds"] * 1e3 for name in r}
        worst = max(r[name]["difference"] for name in r)
        rows.append(
            f"| {length} | {ms['toolkit']:.1f} | {ms['torch allgather']:.1f} | {ms['torch alltoall']:.1f} | "
            f"{ms['toolkit'] / ms['torch allgather']:.2f} | {ms['toolkit'] / ms['torch alltoall']:.2f} | "
            f"{r['toolkit']['bytes']:,} | {r['torch allgather']['bytes']:,} | {r['torch alltoall']['bytes']:,} "
            f"| {worst:.1e} |"
        )
    return "\n".join(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--write", default=None, help="put the table into this markdown file (docs/benchmarks.md)")
    args = parser.parse_args(argv)
    results = toolkit.launch(run_all, 2, args=(args.repeats,), timeout_s=900)[0]
    text = table(results)
    print(f"torch's context_parallel on this machine: {results['torch context_parallel']}\n\n{text}")
    if args.write:
        command = ".venv/bin/python bench/context_parallel.py" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
        body = (
            f"World size 2 (cp 2), gloo on CPU ({platform.machine()}, shared machine), torch {torch.__version__}, "
            f"one thread per rank; attention alone, causal, fp32, batch {BATCH}, {HEADS} heads of {HEAD_DIM}, "
            f"zigzag shards on both sides; one forward + backward, median of {args.repeats - 1} interleaved "
            f"repeats, the slowest rank's. torch's `context_parallel` itself: "
            f"{results['torch context_parallel']} (its ring handles the CUDA kernels only), so torch's side is its "
            f"ring templates with the CPU kernel.\n\n{text}"
        )
        benchlib.write_section(
            args.write, "## Context parallelism against torch's ring (bench/context_parallel.py)", command, body
        )


if __name__ == "__main__":
    main()
