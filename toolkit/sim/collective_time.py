"""How long one collective takes on a two-level cluster: measured bus bandwidth, or the alpha-beta model of its links.

On the presets (a cluster with `published` network measurements, `toolkit.sim.published_collectives`):

- inside a node, a ring collective moves its wire bytes at the bus bandwidth nccl-tests measure for that message
  size on that machine (`all_reduce` with NVLink SHARP on H100, the ring's measured share of it for the others);
  the measurement's latency is in it (small messages reach a small fraction of the link);
- across nodes, the ring is bounded by the slower of that and the network: NCCL's latency (below) plus the wire
  bytes at the network cards' achievable rate in NCCL, g cards at once for g members per node;
- a send between two GPUs runs at the measured point-to-point bandwidth of NVLink, or one card's across nodes;
- every rate is the measured fraction of the datasheet link it was measured on, times this cluster's link, so a
  what-if with faster links scales.

Elsewhere (a user-defined cluster, this machine), the alpha-beta model of the links:

    time = call_latency + (steps - inter_steps) x alpha_intra + inter_steps x alpha_inter + wire / bandwidth

- Steps and bytes on the wire are the ring's (the lessons' algorithms, `toolkit.memory.formulas`):
  all-reduce 2(N-1) steps and 2(N-1)/N of the message, reduce-scatter and all-gather N-1 steps and
  (N-1)/N, broadcast N-1 steps and the whole message; all-to-all is the pairwise exchange.
- Latency follows NCCL's own model: a ring over `nodes` nodes crosses the network on only
  2(nodes-1) of an all-reduce's steps (nodes-1 for the others); the rest are NVLink steps.
- Bandwidth: inside one node the NVLink of one GPU. Across nodes the slowest link bounds the ring, and
  the network side is the node's cards together: a group with g members on each node runs g rings at
  once (NCCL's channels, one per card), so its bandwidth is min(NVLink, g x NIC). A group with one
  member per node (HSDP's replicate group, the experts' data-parallel group) gets one card: that is
  what makes a hierarchy of groups pay.
- All-to-all: every peer at once, the two kinds of link in parallel: latency of each peer's message,
  then max(bytes to peers in the node / NVLink, bytes to other nodes / NIC).

Which links a collective occupies (`resources`) lets the timeline run two collectives at once when they
use different links (an intra-node all-gather beside an inter-node all-reduce; a ring pass's send beside its
receive, which holds none of this rank's: `_p2p_resources`), and queue them when they share one, `lanes` at a
time (`Cluster.collective_lanes`: gloo's worker threads on this machine); for how long (`occupancy_on`): the whole
time on NCCL's presets, only the bytes where the cluster says latency is delay in flight
(`Cluster.latency_holds_link=False`, the emulated link's physics: `toolkit.comm.cost`), so the next message may
start while the last one's latency runs; and a ring or an all-to-all across nodes that the network bounds holds
NVLink only for its bytes' time there (`intra_seconds`), the rest of NVLink's time left to collectives inside the node.
Which ranks a collective joins is what its group says: the global ranks of the group the strategy's code issued it
on, whichever order the mesh lays them out in; `node_of` decides which of them share a node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .hardware import Cluster
from .kernel_time import interpolate

RING_OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


@dataclass(frozen=True)
class CollectiveCost:
    seconds: float
    latency: float  # the alpha part of `seconds` (call latency included)
    link: str  # "intra-node", "inter-node", "intra+inter-node" or "none"
    resources: tuple  # the links it occupies: ("intra",), ("inter",), ("intra", "inter") or ()
    bandwidth: float = math.inf  # bytes/s the bandwidth term ran at (ring ops)
    latency_holds_link: bool = True  # see `Cluster.latency_holds_link`
    lanes: int = 1  # collectives its links run at once: `Cluster.collective_lanes`
    shares: bool = False  # its links share their rate among the collectives on them: `Cluster.links_share`
    cores: float | None = None  # seconds it holds the cores (timeline rule 4); None: (1 - overlap) x seconds
    intra_seconds: float | None = None  # its bytes' time on NVLink, where the network bounds it (see `occupancy_on`)
    from_last_issue: float | None = None  # the part of it that runs from its group's last issue (an emulated link's
    #                                      time: `toolkit.comm.emulate`), which a late peer delays (timeline rule 7)
    late_peers: tuple = ()  # how late the group's last rank issues, by the compute before: `Cluster.late_peers`

    @property
    def occupancy(self) -> float:
        """Seconds its links are held: the whole time, or only the bytes where latency is delay in flight."""
        return self.seconds if self.latency_holds_link else self.seconds - self.latency

    def end_with_late_peers(self, issued: float, compute_s: float, end: float) -> float:
        """When it ends (timeline rule 7), issued at `issued` after this rank computed `compute_s` since its previous
        collective: no earlier than the group's last issue plus the part that runs from it."""
        if self.from_last_issue is None or not self.late_peers:
            return end
        return max(end, issued + last_peer_after(self.late_peers, compute_s) + self.from_last_issue)

    def occupancy_on(self, link: str) -> float:
        """Seconds it holds `link`. A collective across nodes that the network bounds moves its bytes over NVLink
        in less than its whole time: NVLink is busy with it only for that (`intra_seconds`), and another
        communicator's collective inside the node (a tensor-parallel all-reduce beside a data-parallel
        reduce-scatter across nodes: NCCL runs them side by side) uses the rest."""
        if link == "intra" and self.intra_seconds is not None:
            return min(self.occupancy, self.intra_seconds)
        return self.occupancy


def _placement(cluster: Cluster, group) -> tuple[int, int]:
    """(nodes the group spans, fewest members on one of those nodes)."""
    per_node: dict[int, int] = {}
    for r in group:
        node = cluster.node_of(r)
        per_node[node] = per_node.get(node, 0) + 1
    return len(per_node), min(per_node.values())


def _kind(nodes: int, n: int, g: int) -> tuple[str, tuple]:
    if nodes == 1:
        return "intra-node", ("intra",)
    if g == 1:
        return "inter-node", ("inter",)
    return "intra+inter-node", ("intra", "inter")


def ring_steps(op: str, n: int, nodes: int) -> tuple[int, int]:
    """(steps, of which across the network) of a ring collective over n ranks on `nodes` nodes."""
    if op == "all_reduce":
        return 2 * (n - 1), 2 * (nodes - 1)
    return n - 1, nodes - 1


def wire_bytes(op: str, size_bytes: float, n: int) -> float:
    """Bytes each rank sends in the ring algorithm (the door's `size_bytes` convention)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n * size_bytes
    if op == "broadcast":
        return float(size_bytes)
    return (n - 1) / n * size_bytes


def collective_time(
    cluster: Cluster, op: str, size_bytes: float, group, me: int | None = None, args: dict | None = None
) -> CollectiveCost:
    """Seconds that `op` on `size_bytes` (the door's message size) takes for the group of global ranks `group`.

    me: this rank (all-to-all and send/recv need it); args: the door's extra args (all-to-all's
    input_splits/output_splits in rows, send/recv's peer).
    """
    cost = _time_on_links(cluster, op, size_bytes, group, me, args)
    cost = replace(
        cost,
        latency_holds_link=cluster.latency_holds_link,
        lanes=cluster.collective_lanes,
        shares=cluster.links_share,
    )
    if cluster.underlay is None:
        return cost
    # an emulated link (`toolkit.comm.emulate`): an all-to-all first books its chunks on the job's store, a ring
    # collective or a barrier marks its issue there and reads its peers' marks after (host work), the call runs on
    # the real links beneath, then sleeps until the emulated link's time has passed; the bookkeeping and the real
    # call hold the cores as they would alone, the sleep hides whole
    real = collective_time(cluster.underlay, op, size_bytes, group, me, args)
    booked = _bookkeeping(cluster, op, list(group), me, args)
    host = booked + (1 - cluster.underlay.overlap) * real.seconds
    waits = op not in ("send", "recv") and len(list(group)) > 1  # a transfer's pair is matched by the stages' timeline
    return replace(
        cost,
        seconds=max(cost.seconds, booked + real.seconds),
        cores=host,
        from_last_issue=cost.seconds if waits else None,
        late_peers=cluster.late_peers,
    )


def last_peer_after(points: tuple, compute_s: float) -> float:
    """Seconds after a rank's issue its group's last rank issues, each having computed `compute_s` since its previous
    call: linearly between the measured points ((compute, lateness), `Cluster.late_peers`), the nearest end's
    beyond them."""
    if compute_s <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if compute_s <= x1:
            return y0 + (y1 - y0) * (compute_s - x0) / (x1 - x0) if x1 > x0 else y1
    return points[-1][1]


def _bookkeeping(cluster: Cluster, op: str, group: list, me, args) -> float:
    """Host seconds the emulator's store adds to one call: an all-to-all books each peer it sends rows to, a ring
    collective or a barrier of two or more ranks marks its issue and reads its peers' marks; send and recv neither."""
    if op in ("send", "recv") or len(group) < 2:
        return 0.0
    if op != "all_to_all":
        return cluster.marks
    splits = (args or {}).get("input_splits")
    peers = len(group) - 1 if splits is None else sum(1 for p, rows in enumerate(splits) if rows and group[p] != me)
    return cluster.bookings * peers / (len(group) - 1)


def _time_on_links(cluster, op, size_bytes, group, me, args) -> CollectiveCost:
    group, args = list(group), args or {}
    n = len(group)
    if op in ("send", "recv"):
        peer = args.get("peer")
        inside = peer is None or me is None or cluster.node_of(peer) == cluster.node_of(me)
        link = cluster.intra if inside else cluster.inter
        bandwidth = link.bandwidth * _fraction(cluster, "p2p" if inside else "nic")
        latency = cluster.call_latency + link.latency
        return CollectiveCost(
            latency + size_bytes / bandwidth,
            latency,
            "intra-node" if inside else "inter-node",
            _p2p_resources(op, inside),
            bandwidth,
        )
    if n <= 1:
        return CollectiveCost(0.0, 0.0, "none", ())
    nodes, g = _placement(cluster, group)
    label, resources = _kind(nodes, n, g)
    if op == "barrier":
        link = cluster.intra if nodes == 1 else cluster.inter
        latency = cluster.call_latency + math.ceil(math.log2(n)) * link.latency
        return CollectiveCost(latency, latency, label, resources)
    if op == "all_to_all":
        return _all_to_all(cluster, size_bytes, group, me, args, label, resources)
    if op not in RING_OPS:
        raise ValueError(
            f"no time model for collective {op!r}; known: {list(RING_OPS)} + ['all_to_all', 'send', 'recv', 'barrier']."
        )
    steps, inter_steps = ring_steps(op, n, nodes)
    wire = wire_bytes(op, size_bytes, n)
    if cluster.published is not None:
        return _measured_ring(cluster, op, size_bytes, wire, nodes, g, inter_steps, label, resources)
    intra = measured_link(cluster, op, n)
    latency = cluster.call_latency + (steps - inter_steps) * intra.latency + inter_steps * cluster.inter.latency
    bandwidth = intra.bandwidth if nodes == 1 else min(intra.bandwidth, g * cluster.inter.bandwidth)
    on_nvlink = wire / intra.bandwidth if bandwidth < intra.bandwidth else None
    return CollectiveCost(latency + wire / bandwidth, latency, label, resources, bandwidth, intra_seconds=on_nvlink)


def measured_link(cluster, op: str, n: int):
    """The link a collective of `n` ranks runs on inside a node: where this machine was calibrated, what was measured
    for `op` on groups of `n` ranks (while the other groups ran theirs), else for `op` on the whole world; else the
    cluster's link."""
    return cluster.op_links.get((op, n)) or cluster.op_links.get(op, cluster.intra)


def _p2p_resources(op: str, inside: bool) -> tuple:
    """The links a send holds: this rank's outgoing side. A receive holds none of this rank's: its bytes come in on
    the link's other direction (full duplex), carried by the peer's send, so a ring's pass (send to the next rank,
    receive from the previous, `toolkit.parallel.context.ring`) takes one transfer's time, not two."""
    if op == "recv":
        return ()
    return ("intra",) if inside else ("inter",)


def _fraction(cluster, what: str) -> float:
    """The measured fraction of the datasheet link a kind of transfer reaches: "p2p" (NVLink), "nic" (network)."""
    measured = cluster.published
    return 1.0 if measured is None else getattr(measured, what).value


def bus_bandwidth(cluster, op: str, size_bytes: float) -> float:
    """Bytes/s of bus bandwidth a ring collective of `size_bytes` reaches inside a node: nccl-tests' all_reduce at
    that message size (log-log between the sizes measured), the ring's share of it for the others, as a fraction
    of the NVLink it was measured on, times this cluster's."""
    measured = cluster.published
    curve = [(size, busbw * 1e9 / measured.nvlink) for size, busbw in measured.all_reduce_busbw]
    share = 1.0 if op == "all_reduce" else measured.ring_over_all_reduce.value
    return interpolate(curve, max(size_bytes, 1.0)) * share * cluster.intra.bandwidth


def _measured_ring(cluster, op, size_bytes, wire, nodes, g, inter_steps, label, resources) -> CollectiveCost:
    """A ring collective priced on the measurements: inside a node its wire bytes at the measured bus bandwidth for
    its size; across nodes the slower of that and NCCL's latency plus the bytes at g cards' achievable rate."""
    inside = bus_bandwidth(cluster, op, size_bytes)
    seconds, latency, bandwidth = wire / inside, 0.0, inside
    if nodes > 1:
        network = g * cluster.inter.bandwidth * _fraction(cluster, "nic")
        alpha = cluster.call_latency + inter_steps * cluster.inter.latency
        if alpha + wire / network > seconds:
            seconds, latency, bandwidth = alpha + wire / network, alpha, network
    on_nvlink = wire / inside if bandwidth < inside else None  # the network bounds it: NVLink is busy for less
    return CollectiveCost(seconds, latency, label, resources, bandwidth, intra_seconds=on_nvlink)


def _all_to_all(cluster, size_bytes, group, me, args, label, resources) -> CollectiveCost:
    """Pairwise exchange with every peer at once: bytes to each kind of peer over that kind of link."""
    n = len(group)
    me = group[0] if me is None or me not in group else me
    at = group.index(me)
    ins = list(args.get("input_splits") or [1] * n)
    outs = list(args.get("output_splits") or ins)
    row = size_bytes / sum(ins) if sum(ins) else 0.0
    latency, bytes_time = cluster.call_latency, {}
    for kind, link in (("intra", measured_link(cluster, "all_to_all", n)), ("inter", cluster.inter)):
        peers = [
            p for p in range(n) if p != at and (cluster.node_of(group[p]) == cluster.node_of(me)) == (kind == "intra")
        ]
        if not peers:
            continue
        latency += len(peers) * link.latency
        moved = max(sum(ins[p] for p in peers), sum(outs[p] for p in peers)) * row
        bytes_time[kind] = moved / (link.bandwidth * _fraction(cluster, "p2p" if kind == "intra" else "nic"))
    seconds = max(bytes_time.values(), default=0.0)
    both = len(bytes_time) == 2  # peers on both kinds of link: NVLink busy only for its own bytes
    on_nvlink = bytes_time["intra"] if both and bytes_time["intra"] < seconds else None
    return CollectiveCost(latency + seconds, latency, label, resources, intra_seconds=on_nvlink)
