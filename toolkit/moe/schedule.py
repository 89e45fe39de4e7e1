"""FasterMoE's smart schedule: the all-to-all cut into per-peer steps, each block computed as it lands.

The plain layer runs steps 4-6 as three coarse operators: dispatch (one all-to-all), the experts, then
combine (one all-to-all). Nothing computes while rows are on the wire, and nothing travels while the
experts compute. FasterMoE cuts them along the ranks instead. With W ranks, rank i at step j
(the pairwise exchange of ``toolkit.comm.alltoall.pairwise_schedule``):

    S_j   sends its rows for rank (i - j) mod W, receives rank (i + j) mod W's rows for its experts
    C_j   its local experts compute the block that just arrived
    R_j   sends those outputs back to (i + j) mod W, receives its own rows' outputs from (i - j) mod W

Step 0 is the block a rank keeps (no traffic). S_{j+1} is issued before C_j starts, so the next block
travels while this one computes, and R_j leaves as soon as C_j is done: on the timeline, sends and
receives interleave with expert compute. Ideal speedup (Lat_comm + Lat_comp) / max(Lat_comm, Lat_comp).

Groups (``smart_group_size=g``, the paper's granularity): the W ranks form W/g groups of g
consecutive ranks, and the steps run between groups: at step j group i sends to group (i - j) mod
W/g and receives from group (i + j) mod W/g, a block per rank of that group. Fewer, larger steps:
less latency paid per message and per Python call, less to overlap. g = 1 is one rank per group;
g = W is one step, the plain all-to-all done point to point. (The paper's heuristics for choosing the
groups are not implemented: groups are consecutive ranks, a node's when ranks are numbered by node.)

Gradients. Backward is the same schedule run again: the gradient of a rank's outputs goes where its
rows went (like S), the owner computes the experts' backward for that block (vector-Jacobian product;
the weight gradients accumulate), and the rows' gradients return (like R); each step overlaps the next
one's traffic. ``Overlapped`` is that one idea as an autograd function, shared with Tutel's pipelining
(``toolkit.moe.pipeline``): a list of units, each *post* (send out), *compute*, *post back*; forward
computes the experts on each unit, backward their vector-Jacobian products, on the same traffic
pattern. A custom function rather than differentiable send/recv ops: autograd would be free to run
independent per-peer backward nodes in any order, and point-to-point traffic must be issued in the
same order on both ends. Work that is not a unit can run alongside, where it hides traffic
(``Units.alongside``): shadowing's rows kept home (``toolkit.moe.shadow_steps``).

Every transfer goes through ``toolkit.comm`` (``isend`` / ``irecv`` return Handles), so an emulated
link (``toolkit.comm.emulate``) slows each step as a real one would, and the trace labels them
("dispatch step 1/4", "combine step 1/4", "... backward"). Expert compute is a
``moe/{name}/experts`` span per block (``backward=True`` in backward).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from ..trace.events import span

SCHEDULES = ("plain", "smart")


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
# The smart schedule
# ---------------------------------------------------------------------------------------------

class SmartSchedule(Units):
    """Per-group units in pairwise-exchange order: unit j = (S_j, C_j, R_j) of the module docstring.

    With ``group_size`` g the W ranks form W/g groups of consecutive ranks; at step j a rank exchanges
    with every rank of one group, a block per peer (its own block stays put, no traffic).
    """

    def __init__(self, layer, plan, group_size: int = 1):
        self.layer, self.plan, self.group, self.g = layer, plan, layer.group, group_size
        self.ranks = comm.group_ranks(layer.group)
        self.me = layer.rank
        self.n = len(self.ranks) // group_size         # groups, hence steps
        self.count = self.n
        self.send_rows, self.recv_rows = list(plan.send_splits), list(plan.recv_splits)

    def peers(self, k):
        """(ranks sent to, ranks received from) at step k: positions in the process group."""
        mine = self.me // self.g
        to, frm = (mine - k) % self.n, (mine + k) % self.n
        return range(to * self.g, (to + 1) * self.g), range(frm * self.g, (frm + 1) * self.g)

    def _exchange(self, blocks, dests, sources, sizes, like, what, k):
        """Send ``blocks[i]`` to ``dests[i]`` and receive ``sizes[i]`` rows from ``sources[i]`` into one
        buffer (in sources' order); this rank's own block is copied, not sent."""
        buf = like.new_empty((sum(sizes),) + tuple(like.shape[1:]))
        parts = dict(zip(sources, buf.split(sizes)))
        receive, send = [], []
        for src, part in parts.items():
            if src != self.me:
                receive.append(self._tag(comm.irecv(part, self.ranks[src], self.group), what, k))
        for dst, block in zip(dests, blocks):
            if dst == self.me:
                parts[dst].copy_(block)
            else:
                send.append(self._tag(comm.isend(block.contiguous(), self.ranks[dst], self.group), what, k))
        return _Pending(buf, receive, send)

    def _tag(self, handle, what, k):
        return label(handle, f"{what} step {k}/{self.n - 1}", self.layer.name)

    def post(self, x, k, names):
        to, frm = self.peers(k)
        blocks = x.split(self.send_rows)
        return self._exchange([blocks[d] for d in to], to, frm, [self.recv_rows[s] for s in frm], x, names[0], k)

    def block(self, k, received):
        _, frm = self.peers(k)
        counts = self.plan.recv_counts[frm.start:frm.stop]  # rows by sender, then local expert
        return self.layer.compute_experts(received, type(self.plan)(counts, counts))

    def post_back(self, k, y, names):
        to, frm = self.peers(k)
        blocks = y.split([self.recv_rows[s] for s in frm])
        return self._exchange(blocks, frm, to, [self.send_rows[d] for d in to], y, names[1], k)

    def assemble(self, results, like):
        by_group = [None] * self.n
        for k, result in enumerate(results):
            by_group[self.peers(k)[0].start // self.g] = result
        return torch.cat(by_group) if by_group else like.new_empty((0,) + tuple(like.shape[1:]))


def smart_dispatch_compute_combine(layer, rows: torch.Tensor, plan, wrap=None) -> torch.Tensor:
    """Steps 4-6 of ``layer`` (a ``toolkit.moe.MoE`` in a process group) by FasterMoE's smart schedule:
    the contract of ``MoE.dispatch_compute_combine`` (rows sorted by destination in, outputs out)."""
    units = SmartSchedule(layer, plan, layer.smart_group_size)
    return overlapped(wrap(units) if wrap else units, rows, layer)


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
