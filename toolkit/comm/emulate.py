"""An emulated interconnect: collectives that take as long as a real link would, on a laptop.

Why: on one machine every rank talks over loopback, which is nearly free, while the ranks share a few
cores, so computing is slow. A GPU cluster is the other way round. The systems the MoE lessons study
(FasterMoE's smart schedule, Tutel's pipelining, shadowing) are all about the balance between the two,
so a lesson needs to set that balance. ``emulate`` does it honestly: the data still moves for real,
and then the collective is held until the alpha-beta model of the chosen link says it may finish.

    with toolkit.comm.emulate(bandwidth="100 MB/s", latency="50 us"):
        toolkit.launch(fn, 4)            # every rank sees the emulated link (see "Launched ranks")

The model (``comm/cost.py``; alpha = latency, beta = 1 / bandwidth), for one call on idle links:

    all_reduce, reduce_scatter, all_gather, broadcast   alpha_beta_time(op, message bytes, N) on the
                     slowest link the ring crosses
    all_to_all       for each kind of link (intra-, inter-node) this rank exchanges rows with:
                     (peers with rows either way) x alpha + max(bytes sent to them, received) x beta,
                     the two kinds side by side on their separate links: what a rank sends AND what it
                     receives (a rank that sends nothing still waits for what arrives; an empty block
                     is no message). With one kind and even splits this is
                     alpha_beta_time("all_to_all", ...) (pairwise exchange, full-duplex links)
    send, recv       alpha + bytes x beta on the link between the two ranks
    barrier          ceil(log2 N) x alpha (no data: a dissemination barrier's rounds)

Nodes: ranks ``0..k-1`` form node 0, ``k..2k-1`` node 1, ... (``ranks_per_node=k``; the last node may
be smaller). Traffic between two ranks of one node uses the ``intra_node`` link, each rank its own;
``intra_node=None`` leaves it unslowed (only the real loopback): the usual picture of fast NVLink inside
a node, a slow network between nodes. By default every rank is its own node, so every link is the
emulated one.

The node's card is shared. Everything that leaves or enters a node goes through the node's network
card (full duplex: an uplink and a downlink, each ``bandwidth``), and the ranks of the node that cross
nodes at the same time share its bandwidth: their bytes queue on it, each transfer holding it for bytes
x beta (a message's latency is delay, its own, and does not hold the card). Two ranks of one node each
pushing 1 MB to the other node at 100 MB/s therefore take 20 ms together, not 10 ms each: the congestion FasterMoE's
topology-aware gate is about (M workers share W_net). A ring collective crosses each node boundary once (only the rank
whose ring neighbour is on the other node uses the card), so one ring does not congest a card; two rings in parallel
groups do. The ranks are separate processes, so the cards' bookings live in the job's key-value store
(the process group's, an atomic compare-and-set per cross-node call); with one rank per node the card
is the rank's own and nothing is shared.

One link per rank, used in turn. Each rank's own link has a send side and a receive side (full
duplex); a transfer starts when this rank issues it or when the previous transfer on the same side is
done, whichever is later, and ends a modelled time after that; its card part queues on the node's card
meanwhile (the card is another link: the two parts run side by side). So two all-to-alls in flight at
once take twice as long, not the same time: overlapping communication with communication gains
nothing, as on a real link; overlapping it with computation does, which is the point of the lessons.

Backpressure. An all-to-all is booked chunk by chunk, in the pairwise exchange's order (at step i rank j
sends to j - i: every receiver has one sender per step): the chunk for rank p holds the sender's sending
side, then p's receiving side (its own link's, or its card's downlink), where every sender to p queues
(``cost.schedule_all_to_all``). A link's bookings are a calendar (``cost.first_fit``): the ranks' processes
book in whatever order they run, and a chunk wanted early takes a gap before one booked first for later, so
even splits issued together take the model's time. A sender is released when its last chunk is
delivered, not when it has pushed it: three ranks sending 10 ms each to one receiver finish at 10, 20 and
30 ms (the order they issued), with the receiver, not all at 10 ms while it still needs 30. Each
delivery is noted in the job's store (``comm/store_ledger.py``); the receiver reads its notes once the
data has moved (its deadline, an ``Arrival``, is known then). The ring collectives and send/recv book a
rank's receiving side in its own process, so they do not queue behind another rank's all-to-all chunks
into it.

A peer that comes late. The clock starts at this rank's call, and a real link starts a collective when its
last rank arrives: so a call ends no earlier than its group's last issue plus its time on idle links, for
every rank of the group (``comm/deadlines.py``). An all-to-all learns it from what it receives (its senders'
notes); a ring collective or a barrier from its peers' issue times, which each rank marks in the job's store
before its real call and reads once that call is complete. Synchronise (barrier) before timing one collective.

Traces: every emulated span carries ``args.emulated_s`` (the modelled transfer time),
``args.link`` ("inter-node", "intra-node" or "intra+inter-node"), ``args.emulated_queue_s`` (how long
it waited behind earlier transfers: its own, other ranks' on the node's card, or an all-to-all's other
senders at its receivers), for a ring collective ``args.emulated_peers_s`` (how long it waited for a late
peer) and, once waited, ``args.emulated_sleep_s`` (how long this rank slept to honour the model); for an
asynchronous call that sleep is also a "wait" span with ``emulated=True``.
``toolkit.Run.capture`` writes ``meta["emulated_link"]`` (None when off), so a report always says whether the
link was real.

Launched ranks: ``emulate`` also sets the environment variable ``TOOLKIT_EMULATED_LINK``, which
``toolkit.launch`` passes to the ranks it starts; they read it when they import the toolkit. Calling
``emulate`` inside a rank's function works too (that rank only: call it on every rank).

On a GPU (NCCL) the hold happens on the host after the collective: the emulation is meant for CPU runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time

from .cost import Ledger, demand, received_kinds, schedule, schedule_all_to_all
from .deadlines import Arrival, Together, issue_mark, when
from .link import Link, Settings, make_settings, parse_bandwidth, parse_latency  # noqa: F401 - re-exported
from .store_ledger import shared_ledger

ENV = "TOOLKIT_EMULATED_LINK"


# --- the state of this process ----------------------------------------------------------------------
def _from_env() -> Settings | None:
    raw = os.environ.get(ENV)
    if not raw:
        return None
    try:
        return Settings.from_dict(json.loads(raw))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{ENV}={raw!r} is not a valid emulated link ({exc}); unset it or call toolkit.comm.emulate(...)."
        ) from None


_current: Settings | None = _from_env()
_lock = threading.Lock()
_own = Ledger()  # when this rank's links (and, one rank per node, its card) are busy (perf_counter)
_calls: dict = {}  # all-to-alls issued per group: the number that names a call's notes in the store
_links = [True]  # False on a simulated rank (``no_links``): the setting is in force, nothing is booked


def _set(settings: Settings | None) -> None:
    global _current
    _current = settings
    if settings is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = json.dumps(settings.to_dict())
    _own.busy.clear()
    _calls.clear()


class emulate:
    """Slow every collective through ``toolkit.comm`` down to an emulated link (see the module doc).

    bandwidth: bytes/s (number) or a string, "10 Gb/s" or "100 MB/s"; latency: seconds per message
    (alpha), number or "5 us"; both must be positive. ranks_per_node: consecutive ranks per node
    (default 1: every link is this one). intra_node: the link inside a node, dict(bandwidth=...,
    latency=...) or a pair; None leaves it unslowed. shared_card: the ranks of a node share its card to
    the network (default; see "The node's card is shared"); False gives every rank its own, the same
    network without congestion. ``emulate(None)`` switches emulation off.

    Takes effect at once, for this process and the ranks ``toolkit.launch`` starts afterwards; as a
    context manager (``with emulate(...):``) it restores the previous setting on exit.
    """

    def __init__(self, bandwidth, latency="10 us", *, intra_node=None, ranks_per_node=None, shared_card=True):
        settings = (
            None if bandwidth is None else make_settings(bandwidth, latency, intra_node, ranks_per_node, shared_card)
        )
        if bandwidth is None and (intra_node is not None or ranks_per_node is not None):
            raise ValueError("emulate(None) switches emulation off; it takes no intra_node/ranks_per_node.")
        self.previous, self.settings = _current, settings
        _set(settings)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        _set(self.previous)

    def __repr__(self) -> str:
        return f"emulate({self.settings.describe() if self.settings else 'off'})"


@contextlib.contextmanager
def no_links():
    """The emulated link stays in force as a setting (whatever a strategy decides by it, it decides as on a
    real rank), but no call books it or waits for it: on a simulated rank (``toolkit.sim``'s cluster) the
    collectives are fake, move nothing and have no peers to queue with or to hear from (an all-to-all would
    wait for its senders' notes forever); the simulator prices them on its cluster's links instead."""
    before, _links[0] = _links[0], False
    try:
        yield
    finally:
        _links[0] = before


def emulated_link() -> Settings | None:
    """The emulated interconnect in force (Settings: inter, intra, ranks_per_node, node_of), or None."""
    return _current


def emulation_description() -> str:
    """One line for reports: the emulated link in force, or that the links are real."""
    return _current.describe() if _current is not None else "no emulation: real links (loopback on one machine)"


def meta() -> dict | None:
    """What ``Run.capture`` records as ``meta["emulated_link"]``: the settings, or None when off."""
    return _current.to_dict() if _current is not None else None


# --- the model and the bookings --------------------------------------------------------------------
def model_time(settings: Settings, op: str, ranks, me: int, size_bytes: float, extra: dict | None = None):
    """(seconds, link label) that one call of ``op`` by global rank ``me`` needs on idle links (what it
    costs alone; ``comm/cost.py`` has the model, ``demand`` the arguments)."""
    d = demand(settings, op, ranks, me, size_bytes, extra)
    return d.alone, d.label


def _card_ledger(settings: Settings):
    """Where the nodes' cards are booked: the job's store when a node holds several ranks (their
    processes must see each other's transfers), else this process (the card is this rank's own)."""
    if settings.ranks_per_node == 1 or not settings.shared_card:
        return _own
    return shared_ledger()


def book(op: str, ranks, me: int, size_bytes: float, extra: dict):
    """Reserve the links for one call issued now: (deadline, trace args), or None when emulation is off.
    The deadline is perf_counter seconds for send and recv; for an all-to-all an ``Arrival`` (what it receives is
    known once it has moved), for a ring collective or a barrier a ``Together`` (when its peers issued it), each read
    by ``when`` once the real call is complete. Transfers on the same link take turns; across nodes, the
    node's card is shared by its ranks; an all-to-all's chunks queue on their receiver (``comm/cost.py``)."""
    settings = _current
    if settings is None or not _links[0]:
        return None
    d = demand(settings, op, ranks, me, size_bytes, extra)
    args = {"emulated_s": d.alone, "link": d.label}
    group = "-".join(str(r) for r in ranks)
    if op not in ("send", "recv"):
        _calls[group] = call = _calls.get(group, 0) + 1  # every rank of the group numbers its calls alike
    if op == "all_to_all":
        shared = shared_ledger()
        with _lock:
            now = time.perf_counter()
            delivered, messages = schedule_all_to_all(
                shared, _own, settings, list(ranks), me, now, size_bytes, extra, f"a2a/{group}/{call}"
            )
        kinds = received_kinds(settings, list(ranks), me, size_bytes, extra)
        return Arrival(shared, delivered, messages, kinds, f"a2a/{group}/{call}", me, now, d.alone), args
    sides = (op,) if op in ("send", "recv") else ("send", "recv")
    ledger = _card_ledger(settings) if d.up_s or d.down_s else _own
    with _lock:
        now = time.perf_counter()
        deadline = schedule(ledger, _own, settings, d, me, now, sides)
    args["emulated_queue_s"] = max(0.0, deadline - now - d.alone)
    if op in ("send", "recv") or len(ranks) < 2:
        return deadline, args
    shared = shared_ledger()  # the call starts when its last rank has issued it: the peers' marks say when
    issue_mark(shared, group, call, me, now)
    return Together(deadline, shared, group, call, [r for r in ranks if r != me], now, d.alone), args


def hold(event, deadline: float) -> float:
    """Sleep until ``deadline`` (the call's modelled completion) and stretch the span to it. Returns the
    seconds slept (added to ``args.emulated_sleep_s``). For an asynchronous call the sleep is also a
    "wait" span with emulated=True (time the rank could have computed); a synchronous call's span is
    blocking time already."""
    from ..trace.events import recorder

    if not isinstance(deadline, (int, float)):  # how long it queued, or waited for a late peer, is known only now
        deadline.explain(event["args"])
    deadline = when(deadline)
    remaining = deadline - time.perf_counter()
    slept = 0.0
    if remaining > 0:
        waiting = event["args"].get("async_op", False)
        span = recorder.add("wait", "wait", recorder.mark(), op=event["name"], emulated=True) if waiting else None
        time.sleep(remaining)
        slept = remaining
        if span is not None:
            span["end"] = recorder.mark()
    event["args"]["emulated_sleep_s"] = event["args"].get("emulated_sleep_s", 0.0) + slept
    event["end"] = emulated_end(event.get("end"), deadline, slept > 0)
    return slept


def emulated_end(marker, deadline: float, slept: bool = True):
    """A span's end pushed to the modelled deadline. Markers are perf_counter floats on the CPU (the
    recorder reads floats as such on a GPU too); a CUDA event is replaced by the deadline if we slept."""
    if not isinstance(deadline, (int, float)):  # not read yet (gloo's thread): ``hold`` stretches the span later
        return marker
    if marker is None or isinstance(marker, float):
        return max(marker if marker is not None else deadline, deadline)
    return deadline if slept else marker
