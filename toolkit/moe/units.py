"""Steps 4-6 as units that overlap: the machinery shared by the smart schedule, Tutel's chunks and shadowing.

The plain layer runs dispatch, the experts and combine one after the other. Every way of overlapping
them cuts the work into *units*, each posted (its rows sent to the experts' owners), computed (the
experts on the rows received) and posted back (the outputs returned): FasterMoE's smart schedule has
a unit per peer step (``toolkit.moe.schedule``), Tutel a unit per chunk of capacity
(``toolkit.moe.pipeline``). ``run_units`` posts unit k+1 before computing unit k, so the next unit
travels while this one computes.

``Overlapped`` makes that differentiable: forward computes the experts on each unit, backward their
vector-Jacobian products on the same traffic pattern (gradients of outputs go where the rows went,
gradients of rows come back). A custom autograd function rather than differentiable send/recv ops:
autograd would be free to run independent per-peer backward nodes in any order, and point-to-point
traffic must be issued in the same order on both ends.

Work that is not a unit can run alongside, where it hides traffic (``Units.alongside``, ``finish``):
shadowing's rows kept home (``toolkit.moe.shadow_steps``), added to any pattern, including
``WholeExchange``, the plain steps 4-6 as a single unit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from ..trace.events import span


class _Ready:
    """A unit that needs no traffic (the block a rank keeps)."""

    def __init__(self, tensor):
        self.tensor = tensor

    def wait(self):
        return self.tensor


class _Pending:
    """Transfers in flight; ``wait()`` returns the tensor they fill. Sends are waited at the end."""

    def __init__(self, tensor, receive=(), send=()):
        self.tensor, self.receive, self.send = tensor, list(receive), list(send)

    def wait(self):
        for handle in self.receive:
            handle.wait()
        self.receive = []
        return self.tensor

    def finish(self):
        self.wait()
        for handle in self.send:
            handle.wait()
        self.send = []


def label(handle, text: str, layer: str):
    """Name a transfer on the timeline (as the plain layer names its all-to-alls)."""
    handle.event["args"]["moe"] = text
    handle.event["args"]["layer"] = layer
    return handle


class Units:
    """The traffic pattern of an overlapped steps 4-6 (subclasses: smart schedule, pipelined chunks).

    ``x`` is a tensor in the layout of the rows a rank sends (sorted by destination); ``count`` units;
    ``post(x, k, names)`` sends unit k's part of x to the experts' owners and returns something whose
    ``wait()`` gives the rows received for unit k; ``block(k, received)`` computes them (forward:
    the local experts); ``post_back(k, y, names)`` returns the results to their senders; ``assemble``
    puts the results of every unit back in x's layout. ``names`` = (out, back) labels for the trace.
    """

    count = 0

    def post(self, x, k, names):
        raise NotImplementedError

    def block(self, k, received):
        raise NotImplementedError

    def post_back(self, k, y, names):
        raise NotImplementedError

    def assemble(self, results, like):
        raise NotImplementedError

    def alongside(self, backward: bool) -> dict:
        """Work that is not a unit but can hide the units' traffic (shadowing's rows kept home):
        {"early": f(x), "late": f(x)}, see ``run_units``. Nothing by default."""
        return {}

    def finish(self, param_grads: list) -> list:
        """The experts' parameter gradients once backward is done; work alongside may add to them."""
        return param_grads


def run_units(units: Units, x: torch.Tensor, compute, names, early=None, late=None) -> torch.Tensor:
    """Post unit 0; then for each unit k: post unit k+1, wait for k, compute it, post its results back.
    Finally wait for every result and assemble. Communication of k+1 overlaps computation of k.
    ``early(x)`` runs once unit 0 is on the wire, ``late(x)`` once every result is on its way back:
    other computation placed where it hides traffic."""
    results, backs = [None] * units.count, []
    pending = units.post(x, 0, names) if units.count else None
    if early is not None:
        early(x)
    for k in range(units.count):
        following = units.post(x, k + 1, names) if k + 1 < units.count else None
        y = compute(k, pending.wait())
        backs.append(units.post_back(k, y, names))
        if isinstance(pending, _Pending):
            pending.finish()
        pending = following
    if late is not None:
        late(x)
    for k, back in enumerate(backs):
        results[k] = back.wait()
        if isinstance(back, _Pending):
            back.finish()
    return units.assemble(results, x)


FORWARD_NAMES = ("dispatch", "combine")
BACKWARD_NAMES = ("combine backward", "dispatch backward")  # the plain layer's names, in backward order


class Overlapped(torch.autograd.Function):
    """Steps 4-6 on a ``Units`` pattern, differentiable: backward runs the same pattern on gradients.

    Forward keeps, per unit, the received rows (as a leaf) and the experts' output graph; backward
    sends each unit's output gradients to the owners, who take the vector-Jacobian product of their
    block (gradients of the received rows, and of the expert parameters, summed over units) and send
    the rows' gradients home.
    """

    @staticmethod
    def forward(ctx, units, layer_name, x, *params):
        saved = {}

        def forward_block(k, received):
            leaf = received.detach().requires_grad_(True)
            with torch.enable_grad():
                y = units.block(k, leaf)
            saved[k] = (leaf, y)
            return y.detach()

        out = run_units(units, x.detach(), forward_block, FORWARD_NAMES, **units.alongside(backward=False))
        ctx.units, ctx.saved, ctx.layer_name, ctx.params = units, saved, layer_name, params
        return out

    @staticmethod
    def backward(ctx, grad):
        units, saved, params = ctx.units, ctx.saved, ctx.params
        param_grads = [None] * len(params)

        def backward_block(k, grad_y):
            leaf, y = saved.pop(k)
            with span(f"moe/{ctx.layer_name}/experts", rows=int(leaf.shape[0]), backward=True):
                grads = torch.autograd.grad(y, [leaf, *params], grad_y, allow_unused=True)
            for i, g in enumerate(grads[1:]):
                if g is not None:
                    param_grads[i] = g if param_grads[i] is None else param_grads[i] + g
            return grads[0] if grads[0] is not None else torch.zeros_like(leaf)

        grad_x = run_units(units, grad.contiguous(), backward_block, BACKWARD_NAMES, **units.alongside(backward=True))
        return (None, None, grad_x, *units.finish(param_grads))


def overlapped(units: Units, x: torch.Tensor, layer) -> torch.Tensor:
    """Run ``units`` forward (and, when gradients are wanted, backward) for ``layer``'s experts."""
    params = tuple(p for p in layer.experts.parameters() if p.requires_grad)
    if not torch.is_grad_enabled() or not (x.requires_grad or any(p.requires_grad for p in params)):
        with torch.no_grad():
            return run_units(units, x, units.block, FORWARD_NAMES, **units.alongside(backward=False))
    return Overlapped.apply(units, layer.name, x, *params)


# ---------------------------------------------------------------------------------------------
# The plain pattern as one unit (what shadowing adds its home rows to, moe/shadow_steps.py)
# ---------------------------------------------------------------------------------------------


class WholeExchange(Units):
    """Steps 4-6 as a single unit: one asynchronous all-to-all out, the experts, one back. On its own
    nothing overlaps (the layer's plain path says it more simply); work alongside it can."""

    count = 1

    def __init__(self, layer, plan):
        self.layer, self.plan = layer, plan
        self.distributed = dist.is_initialized() and layer.world > 1

    def _exchange(self, x, out_splits, in_splits, name):
        if not self.distributed:
            return _Ready(x)
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        handle = comm.all_to_all(out, x.contiguous(), out_splits, in_splits, group=self.layer.group, async_op=True)
        return _Pending(out, [label(handle, name, self.layer.name)])

    def post(self, x, k, names):
        return self._exchange(x, self.plan.recv_splits, self.plan.send_splits, names[0])

    def block(self, k, received):
        return self.layer.compute_experts(received, self.plan)

    def post_back(self, k, y, names):
        return self._exchange(y, self.plan.send_splits, self.plan.recv_splits, names[1])

    def assemble(self, results, like):
        return results[0]
