"""What one call of a collective costs on the emulated link, rank by rank, and how calls share a node's NIC.

One model serves twice: the emulator (``comm/emulate.py``) holds every call until it says the call may
finish, and the MoE systems that decide from a predicted time (Tutel's switch between data and expert
parallelism, ``moe/placement.py``; the 2DH all-to-all's crossover, lesson 06) predict with it. So a
decision and the time it is then measured in cannot disagree about the physics.

The machine. Every rank has its own link inside its node (NVLink-like; ``intra``, or not slowed at
all). Everything that leaves or enters a node goes through the node's network card, full duplex (an
uplink and a downlink, each ``inter``), whose bandwidth the node's ranks SHARE: the bytes of transfers
that need it at the same time queue on it, each holding it for bytes x beta; a message's latency
(alpha) is its own and does not hold the card (it is delay, not occupancy). With one rank per node
(the default) the card is the rank's own and nothing is shared.

What a call needs (``demand``), for global rank ``me``:

    all_to_all      own:  (peers on my node) x alpha_intra + max(bytes sent to them, received) x beta_intra
                    card: (peers off my node) x alpha, plus the bytes I send off the node x beta on
                          its uplink and the bytes I receive from off the node x beta on its downlink
                    (what a rank sends AND what it receives: a rank that sends nothing still waits for
                    what arrives; a peer counts only with rows either way: an empty block is no message.
                    The emulator books it chunk by chunk, with backpressure: ``schedule_all_to_all``)
    all_reduce, reduce_scatter, all_gather, broadcast    a ring in group order, paced by its slowest hop:
                    alpha_beta_time(op, bytes, N) on the slowest link the ring uses. The rank whose ring
                    successor is on another node holds its uplink for it, the rank whose predecessor is,
                    its downlink; the others only their own link (a ring crosses each node boundary once,
                    so ring collectives do not congest a card, but two rings in parallel groups do)
    send / recv     alpha + bytes x beta on the link between the two ranks (the card, across nodes)
    barrier         ceil(log2 N) x alpha, no data

A call runs its own part and its card part side by side, on their separate links (its card bytes queue
on the card, then its latency runs); ``schedule`` books both on a ``Ledger`` (who is busy until when) and
returns when it may finish. ``alone`` is a call's time on idle links;
``together`` is the time of one collective issued by every rank at the same moment: each node's card
carries all of its ranks' cross-node traffic in turn, which is what the emulator then measures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RING_OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


@dataclass(frozen=True)
class Demand:
    """What one call of one rank needs: seconds on its own link, then its bytes' seconds on its node's
    uplink and downlink (shared) and the latency of its cross-node messages (not shared)."""

    own_s: float = 0.0
    up_s: float = 0.0
    down_s: float = 0.0
    latency_s: float = 0.0
    label: str = "none"

    @property
    def alone(self) -> float:
        """Seconds when no other call uses the links (the modelled transfer time): the own part and the
        card part run side by side, on their separate links."""
        return max(self.own_s, max(self.up_s, self.down_s) + self.latency_s)


def _kind(settings, a: int, b: int) -> str:
    return "intra-node" if settings.node_of(a) == settings.node_of(b) else "inter-node"


def _time(link, messages: float, nbytes: float) -> float:
    return 0.0 if link is None else messages * link.latency + nbytes * link.beta


def demand(settings, op: str, ranks, me: int, size_bytes: float, extra: dict | None = None) -> Demand:
    """What ``op`` issued by global rank ``me`` needs (see the module doc).

    ranks: the group's global ranks; size_bytes: the door's message size (the tensor for all_reduce,
    reduce_scatter's input, all_gather's output); extra: all_to_all's ``input_splits`` /
    ``output_splits`` (rows) and ``row_bytes`` = (bytes of an input row, of an output row), or
    ``sent`` / ``received`` (bytes per group position); send/recv's ``peer`` (global rank).
    """
    from ..memory.formulas import alpha_beta_time

    extra = extra or {}
    ranks = list(ranks)
    if op in ("send", "recv"):
        kind = _kind(settings, me, extra["peer"])
        if kind == "intra-node":
            return Demand(own_s=_time(settings.intra, 1, size_bytes), label=kind)
        seconds, alpha = size_bytes * settings.inter.beta, settings.inter.latency
        return Demand(**{"up_s" if op == "send" else "down_s": seconds}, latency_s=alpha, label=kind)
    n = len(ranks)
    if n <= 1:
        return Demand()
    if op == "all_to_all":
        sent, received = _all_to_all_bytes(ranks.index(me), n, size_bytes, extra)
        parts, kinds = {}, []
        for kind in ("intra-node", "inter-node"):  # a peer with nothing either way gets no message
            peers = [
                p
                for p in range(n)
                if ranks[p] != me and _kind(settings, ranks[p], me) == kind and (sent[p] or received[p])
            ]
            if peers:
                kinds.append(kind)
                parts[kind] = (len(peers), sum(sent[p] for p in peers), sum(received[p] for p in peers))
        own = parts.get("intra-node", (0, 0.0, 0.0))
        cross = parts.get("inter-node")
        label = "intra+inter-node" if len(kinds) == 2 else (kinds[0] if kinds else "none")
        cross = cross or (0, 0.0, 0.0)
        return Demand(
            own_s=_time(settings.intra, own[0], max(own[1], own[2])),
            up_s=cross[1] * settings.inter.beta,
            down_s=cross[2] * settings.inter.beta,
            latency_s=cross[0] * settings.inter.latency,
            label=label,
        )
    spans_nodes = len({settings.node_of(r) for r in ranks}) > 1
    link = settings.inter if spans_nodes else settings.intra
    label = "inter-node" if spans_nodes or settings.ranks_per_node == 1 else "intra-node"
    if link is None:
        return Demand(label=label)
    if op == "barrier":
        return Demand(own_s=math.ceil(math.log2(n)) * link.latency, label=label)
    seconds = alpha_beta_time(op, size_bytes, n, link.latency, link.beta)
    if not spans_nodes:
        return Demand(own_s=seconds, label=label)
    at = ranks.index(me)
    after, before = ranks[(at + 1) % n], ranks[(at - 1) % n]
    up, down = (settings.node_of(r) != settings.node_of(me) for r in (after, before))
    if not (up or down):  # my ring neighbours are on my node: I keep the pace of the ring's slowest hop
        return Demand(own_s=seconds, label=label)
    wire = alpha_beta_time(op, size_bytes, n, 0.0, link.beta)
    return Demand(up_s=wire if up else 0.0, down_s=wire if down else 0.0, latency_s=seconds - wire, label=label)


def _all_to_all_bytes(me_at: int, n: int, size_bytes: float, extra: dict):
    """(bytes sent to, bytes received from) each group position, from the splits and row sizes."""
    if "sent" in extra:
        return list(extra["sent"]), list(extra["received"])
    ins, outs = extra.get("input_splits"), extra.get("output_splits")
    if ins is None:
        return [size_bytes / n] * n, [size_bytes / n] * n
    row_in, row_out = extra.get("row_bytes") or ((size_bytes / sum(ins),) * 2 if sum(ins) else (0.0, 0.0))
    return [s * row_in for s in ins], [s * row_out for s in outs]


# --- who is busy until when ---------------------------------------------------------------------------
FORGET_S = 0.1  # a link forgets the bookings that ended this long before a new call was issued: a call still to be
# booked was issued at most this long before it books (a few round trips to the store), so none can overlap them


def first_fit(busy: list, earliest: float, seconds: float, forget_before: float) -> tuple[float, list]:
    """Where ``seconds`` of a link go on its calendar ``busy`` (sorted, disjoint (start, end) pairs): the first
    gap at or after ``earliest`` they fit in. Returns (their end, the calendar with them, less the bookings that
    ended before ``forget_before``). A calendar, not "free again at": ranks book in whatever order their processes
    run, and a chunk that one rank wants early must not queue behind one that another rank booked first for later."""
    kept = [(s, e) for s, e in busy if e > forget_before]
    start = earliest
    for s, e in kept:
        if start + seconds <= s + 1e-9:  # a nanosecond: the clock's grain, not a float's rounding
            break
        start = max(start, e)
    if seconds > 0:
        kept = sorted(kept + [(start, start + seconds)])
    merged = []  # touching intervals become one
    for s, e in kept:
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(e, merged[-1][1]))
        else:
            merged.append((s, e))
    return start + seconds, merged


class Ledger:
    """When each link is busy (seconds on one clock). Resources: ("rank", r, side) for a rank's own link, side
    "send" or "recv"; ("node", n, side) for a node's card, side "up" or "down". This one lives in one process;
    the emulator's shared one (``comm/store_ledger.py``) has the same methods."""

    def __init__(self):
        self.busy, self.notes = {}, {}

    def free_at(self, resource) -> float:
        """When ``resource``'s last booking ends (0 if it has none)."""
        booked = self.busy.get(resource)
        return booked[-1][1] if booked else 0.0

    def reserve(self, resource, earliest: float, seconds: float, issued: float | None = None) -> float:
        """Hold ``resource`` for ``seconds`` in its first gap from ``earliest`` (``first_fit``), for a call issued at
        ``issued`` (default ``earliest``). Returns the end."""
        forget = (earliest if issued is None else issued) - FORGET_S
        end, self.busy[resource] = first_fit(self.busy.get(resource, []), earliest, seconds, forget)
        return end

    def note(self, key, end: float) -> None:
        """Remember the latest ``end`` said about ``key`` (an all-to-all's chunks into one receiver)."""
        self.notes[key] = max(end, self.notes.get(key, end))

    def take(self, key) -> float:
        """The latest end noted for ``key``, forgotten once read."""
        return self.notes.pop(key)

    def mark(self, key, numbers) -> None:
        """Keep ``numbers`` under ``key`` (a rank's issue mark: ``comm/deadlines.py``)."""
        self.notes[key] = tuple(numbers)

    def marks(self, keys) -> list:
        """The numbers marked under each of ``keys``."""
        return [self.notes.get(key, (-1, 0.0)) for key in keys]


def schedule(ledger, own: Ledger, settings, d: Demand, me: int, now: float, sides=("send", "recv")) -> float:
    """Book call ``d`` of rank ``me`` issued at ``now``: its own part on ``own`` (this rank's link, the
    ``sides`` the call uses), then its card part on ``ledger`` (shared by the node's ranks). Returns
    when the call may finish."""
    start = max([now] + [own.free_at(("rank", me, s)) for s in sides])
    end = start + d.own_s
    if d.own_s > 0:
        for s in sides:
            own.reserve(("rank", me, s), start, d.own_s, now)
    node, card = settings.card_of(me), start  # the card part runs beside the own part, on its own link
    for side, seconds in (("up", d.up_s), ("down", d.down_s)):
        if seconds > 0:
            card = max(card, ledger.reserve(("node", node, side), start, seconds, now))
    return max(end, card + d.latency_s)


def schedule_all_to_all(
    shared, own, settings, ranks, me: int, now: float, size_bytes: float, extra: dict, call
) -> tuple[dict, dict]:
    """Book rank ``me``'s part of one all-to-all, chunk by chunk, with backpressure: the chunk to peer p
    holds my sending side (my own link's send side; across nodes my node card's uplink) and then p's
    receiving side (p's own link's receive side; across nodes p's card's downlink), which every sender to
    p shares, so a chunk is delivered only when p has taken it: senders to a congested receiver finish
    when it has their bytes, not when they have pushed them. Inside and across nodes the chunks run side
    by side on their separate links. Each delivery is noted under (``call``, p, kind) on ``shared``, for
    p to read once the data has moved.

    ``own``: this rank's own links (its process); ``shared``: the resources other ranks book too (the
    job's store). Returns ({kind: when my chunks of that kind are delivered}, {kind: (messages, alpha)}):
    a kind's messages are its peers with rows either way (an empty block sends nothing).
    """
    mine_at, n = ranks.index(me), len(ranks)
    sent, received = _all_to_all_bytes(mine_at, n, size_bytes, extra)
    delivered, messages = {}, {}
    for step in range(1, n):  # the pairwise exchange's order (``alltoall.pairwise_schedule``): at each step
        p = (mine_at - step) % n  # every receiver has one sender, so even splits issued together never queue
        peer = ranks[p]
        if not (sent[p] or received[p]):
            continue
        kind = _kind(settings, peer, me)
        link = settings.intra if kind == "intra-node" else settings.inter
        count, _ = messages.get(kind, (0, 0.0))
        messages[kind] = (count + 1, 0.0 if link is None else link.latency)
        delivered.setdefault(kind, now)
        if not sent[p] or link is None:  # nothing to push, or a link that is not slowed
            continue
        seconds = sent[p] * link.beta
        if kind == "intra-node":
            mine, theirs, ledger = ("rank", me, "send"), ("rank", peer, "recv"), own
        else:
            mine, theirs = ("node", settings.card_of(me), "up"), ("node", settings.card_of(peer), "down")
            ledger = shared if settings.ranks_per_node > 1 and settings.shared_card else own
        pushed = ledger.reserve(mine, now, seconds, now)
        taken = max(pushed, shared.reserve(theirs, pushed - seconds, seconds, now))
        shared.note((call, peer, kind), taken)
        delivered[kind] = max(delivered[kind], taken)
    return delivered, messages


def all_to_all_finish(shared, delivered: dict, messages: dict, received_kinds, call, me: int) -> float:
    """When rank ``me``'s all-to-all may finish: per kind of link, the later of its own chunks' delivery
    and the chunks it receives (read from ``shared``, where their senders noted them), then that kind's
    message latencies; the kinds side by side."""
    finish = max(delivered.values(), default=0.0)
    for kind, (count, alpha) in messages.items():
        mine = delivered[kind]
        if kind in received_kinds:
            mine = max(mine, shared.take((call, me, kind)))
        finish = max(finish, mine + count * alpha)
    return finish


def received_kinds(settings, ranks, me: int, size_bytes: float, extra: dict) -> set:
    """The kinds of link (intra-, inter-node) rank ``me`` receives bytes over in this all-to-all."""
    _, received = _all_to_all_bytes(ranks.index(me), len(ranks), size_bytes, extra)
    kinds = {_kind(settings, peer, me) for p, peer in enumerate(ranks) if peer != me and received[p]}
    return kinds - ({"intra-node"} if settings.intra is None else set())  # an unslowed link notes nothing


def together(settings, demands: dict) -> float:
    """Seconds of one collective that every rank issues at the same moment ({global rank: Demand}):
    booked in rank order on fresh links, so each node's card carries its ranks' traffic in turn.
    The collective's time is its last rank's."""
    ledger = Ledger()
    return max((schedule(ledger, ledger, settings, d, r, 0.0) for r, d in sorted(demands.items())), default=0.0)
