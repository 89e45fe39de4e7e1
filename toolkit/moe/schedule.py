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
one's traffic. The steps are ``Units`` (``toolkit.moe.units``), the machinery this schedule shares
with Tutel's chunks and with shadowing.

Every transfer goes through ``toolkit.comm`` (``isend`` / ``irecv`` return Handles), so an emulated
link (``toolkit.comm.emulate``) slows each step as a real one would, and the trace labels them
("dispatch step 1/4", "combine step 1/4", "... backward"). Expert compute is a
``moe/{name}/experts`` span per block (``backward=True`` in backward).
"""

from __future__ import annotations

import torch

from .. import comm
from .units import Units, _Pending, label, overlapped

SCHEDULES = ("plain", "smart")


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
        self.n = len(self.ranks) // group_size  # groups, hence steps
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
        counts = self.plan.recv_counts[frm.start : frm.stop]  # rows by sender, then local expert
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
