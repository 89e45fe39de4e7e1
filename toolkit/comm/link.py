"""The emulated interconnect's description: links (bandwidth, latency), nodes, and how to write them.

``Link`` is one kind of link (bytes/s and seconds per message); ``Settings`` the whole interconnect: the
link between nodes, the one inside a node (or None: not slowed), how many consecutive ranks share a
node, and whether a node's ranks share its network card. ``make_settings`` validates what a person
wrote ("100 MB/s", "10 Gb/s", "5 us") into Settings. The emulator (``comm/emulate.py``), the cost model
(``comm/cost.py``) and the simulator's hardware presets all read links this way.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

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
            raise ValueError(
                f"emulate: {name}={value!r} is not a bandwidth; write bytes per second as a "
                f"number, or a string like '100 MB/s' (bytes) or '10 Gb/s' (bits)."
            )
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
            raise ValueError(
                f"emulate: {name}={value!r} is not a latency; write seconds as a number, or a "
                f"string like '5 us' or '1 ms'."
            )
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
        return {
            "bandwidth": self.inter.bandwidth,
            "latency": self.inter.latency,
            "intra_node": asdict(self.intra) if self.intra is not None else None,
            "ranks_per_node": self.ranks_per_node,
            "shared_card": self.shared_card,
            "description": self.describe(),
        }

    @classmethod
    def from_dict(cls, d: dict) -> Settings:
        intra = d.get("intra_node")
        return cls(
            Link(float(d["bandwidth"]), float(d["latency"])),
            Link(float(intra["bandwidth"]), float(intra["latency"])) if intra else None,
            int(d.get("ranks_per_node", 1)),
            bool(d.get("shared_card", True)),
        )


def make_settings(bandwidth, latency="10 us", intra_node=None, ranks_per_node=None, shared_card=True) -> Settings:
    """Validate ``emulate``'s arguments into Settings (every parameter must be positive)."""
    inter = Link(parse_bandwidth(bandwidth), parse_latency(latency))
    intra = None
    if intra_node is not None:
        if isinstance(intra_node, Link):
            intra = Link(
                parse_bandwidth(intra_node.bandwidth, "intra_node bandwidth"),
                parse_latency(intra_node.latency, "intra_node latency"),
            )
        elif isinstance(intra_node, dict) and set(intra_node) <= {"bandwidth", "latency"} and "bandwidth" in intra_node:
            intra = Link(
                parse_bandwidth(intra_node["bandwidth"], "intra_node bandwidth"),
                parse_latency(intra_node.get("latency", latency), "intra_node latency"),
            )
        elif isinstance(intra_node, (tuple, list)) and len(intra_node) == 2:
            intra = Link(
                parse_bandwidth(intra_node[0], "intra_node bandwidth"),
                parse_latency(intra_node[1], "intra_node latency"),
            )
        else:
            raise ValueError(
                f"emulate: intra_node={intra_node!r}: give the link inside a node as "
                f"dict(bandwidth=..., latency=...), a (bandwidth, latency) pair, or None "
                f"(traffic inside a node is not slowed)."
            )
        if ranks_per_node is None:
            raise ValueError(
                "emulate: intra_node needs ranks_per_node (how many consecutive ranks share a "
                "node); without it every rank is its own node and there is no intra-node link."
            )
    if ranks_per_node is None:
        ranks_per_node = 1
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"emulate: ranks_per_node must be a positive int, got {ranks_per_node!r}.")
    return Settings(inter, intra, ranks_per_node, bool(shared_card))
