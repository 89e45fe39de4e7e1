"""The hardware a simulated step runs on: a preset, a record, or a user's dict, resolved and checked.

    toolkit.sim.presets()                      # {'dgx-a100': '...', 'dgx-h100': '...', 'this-machine': '...'}
    toolkit.sim.cluster_of("dgx-a100")         # a Cluster
    toolkit.sim.cluster_of(dict(name="fsdp-paper", gpu="a100-80gb", gpus_per_node=8,
                                intra=("300 GB/s", "3.4 us"), inter=("250 Gb/s", "9.6 us")))

The records (`Accelerator`, `Cluster`: what each field means) are in `hardware_records.py`, the presets with their
sources in `hardware_presets.py`. A user-defined accelerator or cluster (a dict) has no measurements: it is priced
at its datasheet numbers (`matmul_efficiency` x peak for GEMMs, the full HBM and link bandwidths, the alpha-beta
model of its links).
"""

from __future__ import annotations

import dataclasses

from ..comm.emulate import Link, parse_bandwidth, parse_latency
from .hardware_presets import CLUSTERS, GPUS, THIS_MACHINE, presets
from .hardware_records import Accelerator, Cluster

# --- resolving what a user passes -----------------------------------------------------------------------
_CLUSTER_FIELDS = ("name", "gpu", "gpus_per_node", "intra", "inter")
_GPU_FIELDS = ("name", "peak_flops", "memory_bytes", "memory_bandwidth")
_EXAMPLE = (
    "dict(name='my-cluster', gpu='a100-80gb', gpus_per_node=8, intra=('300 GB/s', '3.4 us'), "
    "inter=('200 Gb/s', '9.6 us'), call_latency='8.4 us')"
)


def _link(value, what: str) -> Link:
    if isinstance(value, Link):
        return Link(
            parse_bandwidth(value.bandwidth, f"{what} bandwidth"), parse_latency(value.latency, f"{what} latency")
        )
    if isinstance(value, dict) and set(value) == {"bandwidth", "latency"}:
        value = (value["bandwidth"], value["latency"])
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return Link(parse_bandwidth(value[0], f"{what} bandwidth"), parse_latency(value[1], f"{what} latency"))
    raise ValueError(
        f"cluster field {what!r}={value!r}: give a link as (bandwidth, latency), e.g. "
        f"('200 Gb/s', '9.6 us'), or dict(bandwidth=..., latency=...)."
    )


def accelerator(spec) -> Accelerator:
    """An Accelerator from a preset name (see `GPUS`), an Accelerator, or a dict with its fields."""
    if isinstance(spec, Accelerator):
        return spec
    if isinstance(spec, str):
        if spec.lower() not in GPUS:
            raise ValueError(
                f"unknown accelerator {spec!r}; known: {sorted(GPUS)}, or a dict with the fields {list(_GPU_FIELDS)}."
            )
        return GPUS[spec.lower()]
    if isinstance(spec, dict):
        missing = [f for f in _GPU_FIELDS if f not in spec]
        if missing:
            raise ValueError(
                f"accelerator {spec.get('name', '(unnamed)')!r} is missing {missing}; an accelerator "
                f"needs {list(_GPU_FIELDS)} (sms, matmul_efficiency, op_overhead, "
                f"asynchronous, source optional)."
            )
        unknown = set(spec) - {f.name for f in dataclasses.fields(Accelerator)}
        if unknown:
            raise ValueError(
                f"accelerator has unknown fields {sorted(unknown)}; valid: "
                f"{[f.name for f in dataclasses.fields(Accelerator)]}."
            )
        gpu = Accelerator(**spec)
        check_mfu(gpu.matmul_efficiency, "matmul_efficiency")
        return gpu
    raise ValueError(f"an accelerator is a preset name {sorted(GPUS)}, an Accelerator or a dict, not {spec!r}.")


def cluster_of(spec, **changes) -> Cluster:
    """A Cluster from a preset name, a Cluster, or a dict (a user-defined cluster); `changes` override fields.

    "this-machine" is calibrated by measurement: use `toolkit.sim.calibrate.this_machine(world_size)`
    (simulate(..., cluster="this-machine") does it for you).
    """
    if isinstance(spec, str):
        name = spec.lower()
        if name == THIS_MACHINE:
            raise ValueError(
                "'this-machine' is measured, not listed: call toolkit.sim.calibrate.this_machine(world_size) for it."
            )
        if name not in CLUSTERS:
            raise ValueError(
                f"unknown cluster preset {spec!r}; known presets: {sorted(presets())}, or a "
                f"user-defined cluster as a dict, e.g. {_EXAMPLE}."
            )
        found = CLUSTERS[name]
    elif isinstance(spec, Cluster):
        found = spec
    elif isinstance(spec, dict):
        missing = [f for f in _CLUSTER_FIELDS if f not in spec]
        if missing:
            raise ValueError(
                f"cluster {spec.get('name', '(unnamed)')!r} is missing {missing}; a cluster needs "
                f"{list(_CLUSTER_FIELDS)} (call_latency, source optional), e.g. {_EXAMPLE}."
            )
        unknown = set(spec) - set(_CLUSTER_FIELDS) - {"call_latency", "source"}
        if unknown:
            raise ValueError(
                f"cluster has unknown fields {sorted(unknown)}; valid: "
                f"{list(_CLUSTER_FIELDS) + ['call_latency', 'source']}."
            )
        found = Cluster(
            str(spec["name"]),
            accelerator(spec["gpu"]),
            spec["gpus_per_node"],
            _link(spec["intra"], "intra"),
            _link(spec["inter"], "inter"),
            parse_latency(spec["call_latency"], "call_latency") if spec.get("call_latency") else 0.0,
            spec.get("source", "user-defined"),
            links_share=True,  # GPUs under NCCL, as the presets: communicators share a link
        )
    else:
        raise ValueError(
            f"cluster={spec!r}: give a preset name {sorted(presets())}, a Cluster, or a dict such as {_EXAMPLE}."
        )
    if changes:
        unknown = set(changes) - {f.name for f in dataclasses.fields(Cluster)}
        if unknown:
            raise ValueError(
                f"cluster_of(...) got unknown fields {sorted(unknown)}; valid: "
                f"{[f.name for f in dataclasses.fields(Cluster)]}."
            )
        if "gpu" in changes:
            changes["gpu"] = accelerator(changes["gpu"])
        for key in ("intra", "inter"):
            if key in changes:
                changes[key] = _link(changes[key], key)
        found = found.with_changes(**changes)
    gpn = found.gpus_per_node
    if isinstance(gpn, bool) or not isinstance(gpn, int) or gpn < 1:
        raise ValueError(f"cluster {found.name!r}: gpus_per_node must be a positive integer, got {gpn!r}.")
    if isinstance(found.overlap, bool) or not isinstance(found.overlap, (int, float)) or not 0 <= found.overlap <= 1:
        raise ValueError(
            f"cluster {found.name!r}: overlap={found.overlap!r} is the fraction of a collective that can "
            f"hide behind compute, in [0, 1] (1: links beside the compute, as on GPUs)."
        )
    beside = found.beside_compute
    if isinstance(beside, bool) or not isinstance(beside, (int, float)) or not 1 <= beside < float("inf"):
        raise ValueError(
            f"cluster {found.name!r}: beside_compute={beside!r} is how many times longer a collective "
            f"takes in flight beside compute, a finite number >= 1 (1: links of their own, as on GPUs)."
        )
    if not isinstance(found.links_share, bool):
        raise ValueError(
            f"cluster {found.name!r}: links_share={found.links_share!r} is True (collectives on a link share its "
            f"rate, as NCCL's communicators do) or False (they take turns)."
        )
    return found


def check_mfu(mfu, name: str = "mfu") -> float:
    """An achievable fraction of peak lies in (0, 1]."""
    if isinstance(mfu, bool) or not isinstance(mfu, (int, float)) or not 0 < mfu <= 1:
        raise ValueError(
            f"{name}={mfu!r}: the achievable fraction of peak must be in (0, 1] (e.g. 0.5 for half "
            f"of the accelerator's peak FLOP/s)."
        )
    return float(mfu)
