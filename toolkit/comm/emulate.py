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
    all_to_all       for each kind of link (intra-, inter-node) this rank has peers on:
                     (peers) x alpha + max(bytes sent to them, bytes received from them) x beta,
                     the kinds one after the other: what a rank sends AND what it receives (a rank that
                     sends nothing still waits for what arrives). With one kind and even splits this is
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
x beta (a message's latency is delay, its own, and does not hold the card). Two ranks of one node each pushing 1 MB to the other node at 100 MB/s therefore take
20 ms together, not 10 ms each: the congestion FasterMoE's topology-aware gate is about (M workers
share W_net). A ring collective crosses each node boundary once (only the rank whose ring neighbour
is on the other node uses the card), so one ring does not congest a card; two rings in parallel
groups do. The ranks are separate processes, so the cards' bookings live in the job's key-value store
(the process group's, an atomic compare-and-set per cross-node call); with one rank per node the card
is the rank's own and nothing is shared.

One link per rank, used in turn. Each rank's own link has a send side and a receive side (full
duplex); a transfer starts when this rank issues it or when the previous transfer on the same side is
done, whichever is later, and ends a modelled time after that; its card part then queues on the
node's card. So two all-to-alls in flight at once take twice as long, not the same time: overlapping
communication with communication gains nothing, as on a real link; overlapping it with computation
does, which is the point of the lessons.

What the emulation cannot know: when the *other* ranks issue the collective. The clock starts at this
rank's call; a peer that arrives late delays the real completion, and the modelled time is counted
from this rank's call, not from the last arrival. The rank on the critical path (the late one) pays
the full modelled time, so step times stay right; an early rank may see less waiting than on a real
link. Synchronise (barrier) before timing one collective.

Traces: every emulated span carries ``args.emulated_s`` (the modelled transfer time),
``args.link`` ("inter-node", "intra-node" or "intra+inter-node"), ``args.emulated_queue_s`` (how long
it waited behind earlier transfers: its own, or other ranks' on the node's card) and, once waited,
``args.emulated_sleep_s`` (how long this rank slept to honour the model); for an asynchronous call that sleep is also a "wait" span with
``emulated=True``. ``toolkit.Run.capture`` writes ``meta["emulated_link"]`` (None when off), so a
report always says whether the link was real.

Launched ranks: ``emulate`` also sets the environment variable ``TOOLKIT_EMULATED_LINK``, which
``toolkit.launch`` passes to the ranks it starts; they read it when they import the toolkit. Calling
``emulate`` inside a rank's function works too (that rank only: call it on every rank).

On a GPU (NCCL) the hold happens on the host after the collective: the emulation is meant for CPU runs.
"""
from __future__ import annotations

import json
import math
import os
import re
import threading
import time
from dataclasses import asdict, dataclass

from .cost import Ledger, demand, schedule

ENV = "TOOLKIT_EMULATED_LINK"

_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


# --- reading numbers with units ---------------------------------------------------------------------
def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"emulate: {name} must be a positive, finite number, got {value!r}.")
    return float(value)


def parse_bandwidth(value, name: str = "bandwidth") -> float:
    """Bytes per second from a number (bytes/s) or a string: "10 Gb/s" (bits), "100 MB/s" (bytes)."""
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kKmMgGtT]?)([bB])(?:it)?(?:ps|/s)\s*", value)
        if not m:
            raise ValueError(f"emulate: {name}={value!r} is not a bandwidth; write bytes per second as a "
                             f"number, or a string like '100 MB/s' (bytes) or '10 Gb/s' (bits).")
        try:
            number = float(m.group(1))
        except ValueError:
            raise ValueError(f"emulate: {name}={value!r}: {m.group(1)!r} is not a number.") from None
        value = number * _UNITS[m.group(2).lower()] / (8.0 if m.group(3) == "b" else 1.0)
    return _number(name, value)


def parse_latency(value, name: str = "latency") -> float:
    """Seconds from a number (seconds) or a string: "5 us", "1 ms", "2e-6 s"."""
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(s|ms|us|µs|ns)\s*", value)
        if not m:
            raise ValueError(f"emulate: {name}={value!r} is not a latency; write seconds as a number, or a "
                             f"string like '5 us' or '1 ms'.")
        try:
            value = float(m.group(1)) * _TIME_UNITS[m.group(2)]
        except ValueError:
            raise ValueError(f"emulate: {name}={value!r}: {m.group(1)!r} is not a number.") from None
    return _number(name, value)


def _rate(bytes_per_s: float) -> str:
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:g} {unit}"
    return f"{bytes_per_s:g} B/s"


def _time(seconds: float) -> str:
    if seconds >= 1e-3:
        return f"{seconds * 1e3:g} ms"
    return f"{seconds * 1e6:g} µs"


# --- the link ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Link:
    """One kind of link: ``bandwidth`` in bytes/s, ``latency`` (alpha) in seconds per message."""

    bandwidth: float
    latency: float

    @property
    def beta(self) -> float:
        return 1.0 / self.bandwidth

    def describe(self) -> str:
        return f"{_rate(self.bandwidth)}, {_time(self.latency)} latency"


@dataclass(frozen=True)
class Settings:
    """The emulated interconnect: ``inter`` between nodes, ``intra`` inside one (None: not slowed)."""

    inter: Link
    intra: Link | None = None
    ranks_per_node: int = 1
    shared_card: bool = True  # False: every rank has its own card to the network (no congestion)

    def node_of(self, rank: int) -> int:
        return int(rank) // self.ranks_per_node

    def card_of(self, rank: int):
        """The network card a rank's cross-node traffic goes through: its node's, or its own."""
        return self.node_of(rank) if self.shared_card else f"rank {int(rank)}"

    def link(self, ranks) -> Link | None:
        """The link a group of global ranks talks over: intra-node if they share a node, else inter-node."""
        return self.intra if len({self.node_of(r) for r in ranks}) <= 1 else self.inter

    def describe(self) -> str:
        text = f"emulated link: {self.inter.describe()} between nodes"
        if self.ranks_per_node == 1:
            return text + " (every rank its own node)"
        inside = self.intra.describe() if self.intra is not None else "not slowed (real loopback)"
        card = "one card per node, shared" if self.shared_card else "one card per rank (no congestion)"
        return text + f" ({card}); inside a node of {self.ranks_per_node} ranks: {inside}"

    def to_dict(self) -> dict:
        return {"bandwidth": self.inter.bandwidth, "latency": self.inter.latency,
                "intra_node": asdict(self.intra) if self.intra is not None else None,
                "ranks_per_node": self.ranks_per_node, "shared_card": self.shared_card,
                "description": self.describe()}

    @classmethod
    def from_dict(cls, d: dict) -> "Settings":
        intra = d.get("intra_node")
        return cls(Link(float(d["bandwidth"]), float(d["latency"])),
                   Link(float(intra["bandwidth"]), float(intra["latency"])) if intra else None,
                   int(d.get("ranks_per_node", 1)), bool(d.get("shared_card", True)))


def make_settings(bandwidth, latency="10 us", intra_node=None, ranks_per_node=None, shared_card=True) -> Settings:
    """Validate ``emulate``'s arguments into Settings (every parameter must be positive)."""
    inter = Link(parse_bandwidth(bandwidth), parse_latency(latency))
    intra = None
    if intra_node is not None:
        if isinstance(intra_node, Link):
            intra = Link(parse_bandwidth(intra_node.bandwidth, "intra_node bandwidth"),
                         parse_latency(intra_node.latency, "intra_node latency"))
        elif isinstance(intra_node, dict) and set(intra_node) <= {"bandwidth", "latency"} and "bandwidth" in intra_node:
            intra = Link(parse_bandwidth(intra_node["bandwidth"], "intra_node bandwidth"),
                         parse_latency(intra_node.get("latency", latency), "intra_node latency"))
        elif isinstance(intra_node, (tuple, list)) and len(intra_node) == 2:
            intra = Link(parse_bandwidth(intra_node[0], "intra_node bandwidth"),
                         parse_latency(intra_node[1], "intra_node latency"))
        else:
            raise ValueError(f"emulate: intra_node={intra_node!r}: give the link inside a node as "
                             f"dict(bandwidth=..., latency=...), a (bandwidth, latency) pair, or None "
                             f"(traffic inside a node is not slowed).")
        if ranks_per_node is None:
            raise ValueError("emulate: intra_node needs ranks_per_node (how many consecutive ranks share a "
                             "node); without it every rank is its own node and there is no intra-node link.")
    if ranks_per_node is None:
        ranks_per_node = 1
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"emulate: ranks_per_node must be a positive int, got {ranks_per_node!r}.")
    return Settings(inter, intra, ranks_per_node, bool(shared_card))


# --- the state of this process ----------------------------------------------------------------------
def _from_env() -> Settings | None:
    raw = os.environ.get(ENV)
    if not raw:
        return None
    try:
        return Settings.from_dict(json.loads(raw))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{ENV}={raw!r} is not a valid emulated link ({exc}); unset it or call "
                         f"toolkit.comm.emulate(...).") from None


_current: Settings | None = _from_env()
_lock = threading.Lock()
_own = Ledger()  # when this rank's links (and, one rank per node, its card) are free again (perf_counter)
_shared: dict = {}  # the job's store and the ledger on it, once a node holds several ranks


def _set(settings: Settings | None) -> None:
    global _current
    _current = settings
    if settings is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = json.dumps(settings.to_dict())
    _own.free.clear()


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
        settings = None if bandwidth is None else make_settings(bandwidth, latency, intra_node, ranks_per_node,
                                                                 shared_card)
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


class _StoreLedger:
    """The node cards' ledger shared by every rank of the job, in the process group's key-value store:
    a reservation is an atomic compare-and-set of "free again at" (one clock: perf_counter is the
    machine's monotonic clock, the same in every process). Same methods as ``cost.Ledger``."""

    PREFIX = "toolkit/emulated_link/"

    def __init__(self, store):
        self.store = store

    def reserve(self, resource, earliest: float, seconds: float) -> float:
        key = self.PREFIX + "/".join(str(part) for part in resource)
        current = self.store.compare_set(key, "", "0.0")
        while True:
            end = max(earliest, float(current)) + seconds
            wanted = repr(end).encode()
            current = self.store.compare_set(key, current, wanted)
            if current == wanted:
                return end


def _card_ledger(settings: Settings):
    """Where the nodes' cards are booked: the job's store when a node holds several ranks (their
    processes must see each other's transfers), else this process (the card is this rank's own)."""
    import torch.distributed as dist

    if settings.ranks_per_node == 1 or not settings.shared_card or not dist.is_initialized():
        return _own
    store = dist.distributed_c10d._get_default_store()
    if _shared.get("store") is not store:
        _shared.update(store=store, ledger=_StoreLedger(store))
    return _shared["ledger"]


def book(op: str, ranks, me: int, size_bytes: float, extra: dict):
    """Reserve the links for one call issued now: (deadline in perf_counter seconds, trace args), or None
    when emulation is off. Transfers on the same link take turns; across nodes, the node's card is
    shared by its ranks (``comm/cost.py``)."""
    settings = _current
    if settings is None:
        return None
    d = demand(settings, op, ranks, me, size_bytes, extra)
    sides = (op,) if op in ("send", "recv") else ("send", "recv")
    ledger = _card_ledger(settings) if d.up_s or d.down_s else _own
    with _lock:
        now = time.perf_counter()
        deadline = schedule(ledger, _own, settings, d, me, now, sides)
    return deadline, {"emulated_s": d.alone, "link": d.label, "emulated_queue_s": max(0.0, deadline - now - d.alone)}


def hold(event, deadline: float) -> float:
    """Sleep until ``deadline`` (the call's modelled completion) and stretch the span to it. Returns the
    seconds slept (added to ``args.emulated_sleep_s``). For an asynchronous call the sleep is also a
    "wait" span with emulated=True (time the rank could have computed); a synchronous call's span is
    blocking time already."""
    from ..trace.events import recorder

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
    if marker is None or isinstance(marker, float):
        return max(marker if marker is not None else deadline, deadline)
    return deadline if slept else marker
