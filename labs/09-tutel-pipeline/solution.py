"""Lab 09, the reference solution: Tutel's pipelined all-to-all (chunks along the capacity, chunk k+1's
exchange overlapping chunk k's experts).

Self-contained on purpose (the lab stands alone); `toolkit/moe/pipeline.py` and `toolkit/moe/units.py`
are the same idea inside the toolkit's MoE layer (uneven splits, an adaptive degree).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from toolkit import comm
from toolkit.trace.events import recorder, span


def split_capacity(x: torch.Tensor, degree: int) -> list[torch.Tensor]:
    if degree < 1:
        raise ValueError(f"degree must be >= 1, got {degree}")
    return [c for c in x.tensor_split(degree, dim=1) if c.shape[1] > 0]


def run_pipeline(x: torch.Tensor, degree: int, compute, group, names) -> torch.Tensor:
    chunks = split_capacity(x, degree)
    count = len(chunks)
    pending = exchange(chunks[0], group, names[0], 0, count)
    backs = []
    for k in range(count):
        following = exchange(chunks[k + 1], group, names[0], k + 1, count) if k + 1 < count else None
        y = compute(k, pending.wait())
        backs.append(exchange(y, group, names[1], k, count))
        pending = following
    return torch.cat([back.wait() for back in backs], dim=1)


# --- given: the experts, one exchange, and autograd through your pipeline ----------------------------------
class Experts(nn.Module):
    """This rank's E_local experts, each a two-layer MLP: y = relu(x @ w1[e]) @ w2[e]."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(w1.clone()), nn.Parameter(w2.clone())  # (E_local, d, h), (E_local, h, d)

    def forward(self, received: torch.Tensor) -> torch.Tensor:
        """received: (W * E_local, c, d), grouped by sender, then by this rank's local expert."""
        world = received.shape[0] // self.w1.shape[0]
        rows = received.view(world, self.w1.shape[0], -1, received.shape[-1])  # (W, E_local, c, d)
        hidden = torch.relu(torch.einsum("seci,eih->sech", rows, self.w1))
        return torch.einsum("sech,ehi->seci", hidden, self.w2).reshape(received.shape)


class Pending:
    """An all-to-all in flight: `wait()` returns the received tensor (and notes when it was first asked for)."""

    def __init__(self, out, handle):
        self.out, self.handle = out, handle

    def wait(self) -> torch.Tensor:
        if self.handle is not None:
            self.handle.event["args"]["waited_at"] = recorder.mark()
            self.handle.wait()
            self.handle = None
        return self.out


def exchange(chunk: torch.Tensor, group, name: str, k: int, count: int) -> Pending:
    """Post the all-to-all of one chunk (equal splits along dim 0: rows [j*E_local, (j+1)*E_local) go to
    rank j) and return at once; `.wait()` gives what arrived. Labelled "<name> chunk k+1/count" on the trace."""
    chunk = chunk.contiguous()
    out = torch.empty_like(chunk)
    handle = comm.all_to_all(out, chunk, group=group, async_op=True)
    handle.event["args"]["moe"] = f"{name} chunk {k + 1}/{count}"
    return Pending(out, handle)


class Pipelined(torch.autograd.Function):
    """Your `run_pipeline`, differentiable: backward runs the same pipeline on the gradients (the outputs'
    gradients travel to the experts' ranks, the inputs' gradients come back), chunk by chunk."""

    @staticmethod
    def forward(ctx, x, degree, experts, group, *params):
        saved = {}

        def forward_chunk(k, received):
            leaf = received.detach().requires_grad_(True)
            with torch.enable_grad(), span(f"experts chunk {k + 1}", chunk=k):
                y = experts(leaf)
            saved[k] = (leaf, y)
            return y.detach()

        out = run_pipeline(x.detach(), degree, forward_chunk, group, ("dispatch", "combine"))
        ctx.saved, ctx.degree, ctx.group, ctx.params = saved, degree, group, params
        return out

    @staticmethod
    def backward(ctx, grad):
        grads = [torch.zeros_like(p) for p in ctx.params]

        def backward_chunk(k, grad_y):
            leaf, y = ctx.saved.pop(k)
            with span(f"experts chunk {k + 1} backward", chunk=k, backward=True):
                g = torch.autograd.grad(y, [leaf, *ctx.params], grad_y)
            for total, part in zip(grads, g[1:]):
                total.add_(part)
            return g[0]

        grad_x = run_pipeline(
            grad.contiguous(), ctx.degree, backward_chunk, ctx.group, ("combine backward", "dispatch backward")
        )
        return (grad_x, None, None, None, *grads)


def pipelined_experts(x: torch.Tensor, degree: int, experts: Experts, group=None) -> torch.Tensor:
    """Steps 4-6 of an MoE layer (dispatch, experts, combine) for x of shape (E, C, d), pipelined in
    `degree` chunks along the capacity C. Differentiable in x and in the experts' weights."""
    return Pipelined.apply(x, degree, experts, group, *experts.parameters())
