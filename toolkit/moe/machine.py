"""What the MoE systems' models know about the machine: compute rate, bandwidths, nodes.

FasterMoE's shadowing predictor and topology-aware gate, and Tutel's choice between data and expert
parallelism for the expert weights, all weigh computation against communication. None of their
numbers is hard-coded; each comes, first match wins, from

1. the caller: ``compute_flops=`` (FLOP/s of one rank's GEMMs), ``bandwidth=`` (bytes/s of the link
   an all-to-all crosses, W_net), ``local_bandwidth=`` (bytes/s inside a node, W_local),
   ``node_size=`` (ranks per node, M);
2. the emulated link (``toolkit.comm.emulate``) when one is on: the bandwidth of the link the
   group's all-to-all crosses (inter-node once the group spans nodes), the intra-node bandwidth and
   the ranks per node;
3. a measurement on this machine: a small timed GEMM of the experts' shape (FLOP/s) and a timed
   all-to-all through the door (bytes/s). A node's topology cannot be measured on one host.

Measuring is collective: every rank times its own, then the ranks agree on the slowest (an all-reduce
MAX of the times, since a step waits for its slowest rank). Agreement matters: the models drive
decisions (which experts to shadow) that change which collectives run, and a decision that differed
between ranks would hang the next one. Measured rates are cached per process, so a layer measures once.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import comm
from ..trace.events import recorder

_cache: dict = {}


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")
    return float(value)


# --- the emulated link -------------------------------------------------------------------------------
def emulated_link(group=None) -> dict | None:
    """The emulated link in force (``toolkit.comm.emulate``) as the models need it, else None.

    bandwidth / latency: the inter-node link; intra_node: bytes/s inside a node (None: not slowed,
    the real loopback); ranks_per_node; group_link: bytes/s of the link ``group``'s all-to-all crosses
    (inter-node as soon as the group spans two nodes; None when that is the unslowed intra-node one).
    """
    settings = comm.emulated_link()
    if settings is None:
        return None
    ranks = comm.group_ranks(group) if dist.is_initialized() else [0]
    used = settings.link(ranks)
    return {
        "bandwidth": settings.inter.bandwidth,
        "latency": settings.inter.latency,
        "intra_node": settings.intra.bandwidth if settings.intra is not None else None,
        "ranks_per_node": settings.ranks_per_node,
        "group_link": used.bandwidth if used is not None else None,
    }


# --- measurements ------------------------------------------------------------------------------------
def time_gemm(d_model: int, d_ff: int, rows: int = 512, repeats: int = 5, dtype=torch.float32) -> float:
    """Median seconds of one (rows, d_model) @ (d_model, d_ff) GEMM on this rank (2*rows*d_model*d_ff FLOPs)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, d_model, generator=g).to(dtype)
    w = torch.randn(d_model, d_ff, generator=g).to(dtype)
    x @ w  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x @ w
        times.append(time.perf_counter() - start)
    return max(statistics.median(times), 1e-9)


def time_all_to_all(group=None, nbytes: int = 1 << 20, repeats: int = 3) -> tuple[float, float]:
    """(median seconds, bytes each rank sent to the others) of an all-to-all of ``nbytes`` per rank
    (equal splits) through the door. Collective."""
    n = len(comm.group_ranks(group))
    numel = max(n, nbytes // 4 // n * n)
    x, out = torch.ones(numel), torch.empty(numel)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        comm.all_to_all(out, x, group=group)
        _label("calibrate")
        times.append(time.perf_counter() - start)
    return max(statistics.median(times[1:]), 1e-9), numel * 4 * (n - 1) / n


def _label(label: str) -> None:
    """Name the last collective on the timeline (as the layer names counts, dispatch, combine)."""
    events = recorder.events
    if recorder.enabled and events and events[-1]["cat"] == "comm":
        events[-1]["args"]["moe"] = label


# --- what the models use -----------------------------------------------------------------------------
@dataclass
class Rates:
    """Compute rate P (FLOP/s) and bandwidth W_net (bytes/s), and where each came from."""

    compute_flops: float
    bandwidth: float
    source: dict = field(default_factory=dict)  # {"compute_flops": "given" | "measured" | "emulated", ...}

    def as_dict(self) -> dict:
        return {"compute_flops": self.compute_flops, "bandwidth": self.bandwidth, "source": dict(self.source)}


def machine_rates(d_model: int, d_ff: int, *, group=None, compute_flops=None, bandwidth=None) -> Rates:
    """P and W_net for an MoE layer of this shape on ``group``: given, emulated, or measured (collective).

    With one rank (or no process group) nothing travels: an unmeasurable bandwidth is reported as
    ``math.inf`` (communication costs nothing).
    """
    source = {}
    P = _positive("compute_flops", compute_flops) if compute_flops is not None else None
    W = _positive("bandwidth", bandwidth) if bandwidth is not None else None
    if P is not None:
        source["compute_flops"] = "given"
    if W is not None:
        source["bandwidth"] = "given"
    world = len(comm.group_ranks(group)) if dist.is_initialized() else 1
    if W is None:
        link = emulated_link(group)
        if link is not None and link["group_link"] is not None:
            W, source["bandwidth"] = float(link["group_link"]), "emulated"
    if P is None or W is None:
        key = (tuple(comm.group_ranks(group)) if dist.is_initialized() else (0,), d_model, d_ff, P is None, W is None)
        if key not in _cache:
            gemm = time_gemm(d_model, d_ff) if P is None else 0.0
            a2a, moved = time_all_to_all(group) if W is None and world > 1 else (0.0, 0.0)
            if dist.is_initialized() and world > 1:  # agree: the slowest rank's times
                both = torch.tensor([gemm, a2a], dtype=torch.float64)
                comm.all_reduce(both, op="max", group=group)
                _label("calibrate")
                gemm, a2a = both.tolist()
            _cache[key] = (
                2.0 * 512 * d_model * d_ff / gemm if P is None else None,
                (moved / a2a if a2a > 0 else math.inf) if W is None else None,
            )
        measured_P, measured_W = _cache[key]
        if P is None:
            P, source["compute_flops"] = measured_P, "measured"
        if W is None:
            W, source["bandwidth"] = measured_W, "measured"
    return Rates(P, W, source)


def node_size(world: int, given=None) -> int:
    """Ranks per node for Tutel's 2DH all-to-all: ``given``, else the emulated link's ranks_per_node."""
    link = emulated_link() or {}
    M = given if given is not None else link.get("ranks_per_node")
    if M is None:
        raise ValueError(
            "all_to_all_algorithm='2dh' needs the nodes: pass node_size= (ranks per node) or turn on an "
            "emulated link with toolkit.comm.emulate(..., ranks_per_node=...)."
        )
    if isinstance(M, bool) or not isinstance(M, int) or M < 1 or world % M:
        fits = [m for m in range(1, world + 1) if world % m == 0]
        raise ValueError(
            f"node_size={M!r} must divide the {world} ranks of the group (every node holds the same "
            f"number); choose one of {fits}."
        )
    return M


def all_to_all_node_size(world: int, algorithm: str, given=None):
    """Ranks per node for the layer's all-to-all: "2dh" needs them (``node_size``); "auto" takes them given or
    from the emulated link, else one rank per node (then always flat); "flat" none."""
    if algorithm == "2dh":
        return node_size(world, given)
    if algorithm == "auto":
        link = comm.emulated_link()
        return node_size(world, given or (link.ranks_per_node if link else 1))
    return None


def topology(world: int, *, node_size=None, bandwidth=None, local_bandwidth=None) -> dict:
    """Node size M and the fraction W_net / (M * W_local) for the topology-aware gate.

    From the arguments, else from the emulated link (ranks_per_node, bandwidth, intra_node). Raises a
    ValueError that says what to pass when something is missing or inconsistent.
    """
    link = emulated_link() or {}
    if link and local_bandwidth is None and link["intra_node"] is None and (node_size or link["ranks_per_node"]) > 1:
        raise ValueError(
            "gate='topology': the emulated link leaves traffic inside a node unslowed "
            "(intra_node=None), so W_local is unknown. Emulate it, e.g. toolkit.comm.emulate(..., "
            "intra_node=dict(bandwidth='10 GB/s'), ranks_per_node=...), or pass local_bandwidth=."
        )
    source = {}
    M = node_size if node_size is not None else link.get("ranks_per_node")
    source["node_size"] = "given" if node_size is not None else "emulated"
    W_net = bandwidth if bandwidth is not None else link.get("bandwidth")
    source["bandwidth"] = "given" if bandwidth is not None else "emulated"
    W_local = local_bandwidth if local_bandwidth is not None else link.get("intra_node")
    source["local_bandwidth"] = "given" if local_bandwidth is not None else "emulated"
    missing = [name for name, v in (("node_size", M), ("bandwidth", W_net), ("local_bandwidth", W_local)) if v is None]
    if missing:
        raise ValueError(
            f"gate='topology' needs the nodes and their links; missing {missing}. Turn on an emulated "
            f"link with toolkit.comm.emulate(bandwidth=..., intra_node=..., ranks_per_node=...) or "
            f"pass node_size= (ranks per node), bandwidth= (cross-node bytes/s) and "
            f"local_bandwidth= (intra-node bytes/s) to the MoE layer."
        )
    if isinstance(M, bool) or not isinstance(M, int) or M < 1:
        raise ValueError(f"node_size must be an int >= 1 (ranks per node), got {M!r}.")
    if world % M:
        fits = [m for m in range(1, world + 1) if world % m == 0]
        raise ValueError(
            f"node_size={M} does not divide the world size {world}: every node must hold the same "
            f"number of ranks. Choose one of {fits}."
        )
    W_net, W_local = _positive("bandwidth", W_net), _positive("local_bandwidth", W_local)
    return {
        "node_size": M,
        "bandwidth": W_net,
        "local_bandwidth": W_local,
        "cross_fraction": W_net / (M * W_local),
        "source": source,
    }


def all_to_all_nodes(layer, rows):
    """``all_to_all_algorithm="auto"``: the node size for Tutel's 2DH all-to-all, or None for the flat one
    (``comm.hierarchical.choose``), from the largest dispatch of any rank (one small all-reduce on an
    emulated link, so every rank prices the same message and decides alike). Recorded as
    ``moe/{name}/all_to_all``."""
    from ..comm import hierarchical
    from .load import enclosing_step

    if layer.all_to_all_algorithm != "auto" or not dist.is_initialized():
        return None
    largest = torch.tensor([float(rows.numel() * rows.element_size())])
    link = comm.emulated_link()
    if link is not None:
        handle = comm.all_reduce(largest, op="max", group=layer.group, async_op=True)
        handle.event["args"]["moe"] = "all-to-all choice"
        handle.wait()
    choice, reason = hierarchical.choose(link, layer.world, layer.node_size, largest.item())
    if recorder.enabled:
        recorder.metric(
            f"moe/{layer.name}/all_to_all",
            {"choice": choice, "reason": reason, "bytes_per_rank": largest.item()},
            step=enclosing_step(),
        )
    return layer.node_size if choice == "2dh" else None
