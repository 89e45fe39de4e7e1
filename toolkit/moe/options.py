"""The MoE layer's options: which names exist, which combinations can work, and what the layer accepts.

The systems options (FasterMoE, Tutel), the layer's sizes and how its experts fit the expert-parallel
group, and the tokens a forward takes: each mistake a ValueError (or TypeError) that says what to do,
raised before any collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from .placement import Placement


def check_systems_options(
    shadow,
    pipeline_degree,
    schedule,
    gate,
    expert_parallel="ep",
    node_size=None,
    local_bandwidth=None,
    smart_group_size=1,
    all_to_all_algorithm="flat",
) -> None:
    """The systems options (FasterMoE, Tutel): unknown names and combinations that cannot work are ValueErrors."""
    if not (isinstance(shadow, (list, tuple)) or shadow in ("auto", "off")):
        raise ValueError(f"shadow={shadow!r}: choose 'off', 'auto' or a list of expert ids.")
    Placement(expert_parallel)  # validates the name
    if shadow != "off" and expert_parallel != "ep":
        raise ValueError(
            f"shadow={shadow!r} needs expert_parallel='ep': with {expert_parallel!r} every rank may "
            f"already use every expert (data parallelism is shadowing them all)."
        )
    if all_to_all_algorithm not in ("flat", "2dh", "auto"):
        raise ValueError(
            f"all_to_all_algorithm={all_to_all_algorithm!r}: choose 'flat' (one all-to-all over the group), "
            f"'2dh' (Tutel's two-level one: inside each node, then across nodes) or 'auto' (the faster "
            f"per forward, comm/hierarchical.py's choose)."
        )
    if all_to_all_algorithm != "flat" and (shadow != "off" or schedule != "plain" or pipeline_degree != 1):
        raise ValueError(
            f"all_to_all_algorithm={all_to_all_algorithm!r} replaces the plain layer's dispatch and "
            "combine; it does not combine with shadow=, schedule='smart' or pipeline_degree= here: "
            "choose one."
        )
    if gate != "topology" and local_bandwidth is not None:
        raise ValueError("local_bandwidth= describes the nodes for gate='topology'; pass it with it.")
    if gate != "topology" and all_to_all_algorithm == "flat" and node_size is not None:
        raise ValueError(
            "node_size= describes the nodes for gate='topology' or all_to_all_algorithm='2dh'; pass it "
            "with one of them."
        )
    if pipeline_degree != "auto" and (
        isinstance(pipeline_degree, bool) or not isinstance(pipeline_degree, int) or pipeline_degree < 1
    ):
        raise ValueError(f"pipeline_degree={pipeline_degree!r}: choose a positive int (1 = no pipelining) or 'auto'.")
    if schedule not in ("plain", "smart"):
        raise ValueError(f"schedule={schedule!r}: choose 'plain' or 'smart'.")
    if schedule == "smart" and pipeline_degree != 1:  # moe/schedule.py and moe/pipeline.py: one at a time
        raise ValueError(
            f"schedule='smart' and pipeline_degree={pipeline_degree!r} are two ways to overlap the "
            f"all-to-alls with the experts: choose one (pipeline_degree=1, or schedule='plain')."
        )
    if gate not in ("topk", "topology"):
        raise ValueError(f"gate={gate!r}: choose 'topk' or 'topology'.")
    if isinstance(smart_group_size, bool) or not isinstance(smart_group_size, int) or smart_group_size < 1:
        raise ValueError(
            f"smart_group_size={smart_group_size!r}: choose a positive int (ranks per group of the smart "
            f"schedule; 1 = one rank per step)."
        )
    if smart_group_size != 1 and schedule != "smart":
        raise ValueError(f"smart_group_size={smart_group_size} groups the ranks of schedule='smart'; pass it with it.")


def check_sliceable(shadow, schedule, pipeline_degree, gate) -> None:
    """More ranks than experts (moe/sharded.py) runs the plain steps 2-6 (flat or 2DH all-to-all)."""
    if shadow != "off" or schedule != "plain" or pipeline_degree != 1 or gate != "topk":
        raise ValueError(
            "MoE: with more ranks than experts each expert is sliced over several ranks (Tutel's "
            "EP+DP+MP); shadow=, schedule='smart', pipeline_degree= and gate='topology' assume whole "
            "experts on their owners. Use at least as many experts as ranks for them."
        )


def expert_parallel_ranks(group, distributed: bool = True) -> tuple[int, int]:
    """(W, this rank's place among them) for the expert-parallel ``group``; (1, 0) for one process alone."""
    if not distributed:
        return 1, 0
    ranks = comm.group_ranks(group)
    if dist.get_rank() not in ranks:
        raise ValueError(
            f"MoE: this rank ({dist.get_rank()}) is not in the expert-parallel group {ranks}; "
            f"build the layer only on the group's ranks."
        )
    return len(ranks), ranks.index(dist.get_rank())


def check_layer(d_model, d_ff, num_experts, world: int, expert_slices, smart_group_size, dropless, dynamic_capacity):
    """The layer's sizes (positive ints); its experts over the ``world`` ranks of the expert-parallel group:
    evenly, each whole (E >= W) or sliced over W / E ranks (``expert_slices``, moe/sharded.py); the smart
    schedule's groups divide the ranks; one way to set the capacity from the load."""
    for key, value in (("d_model", d_model), ("d_ff", d_ff), ("num_experts", num_experts)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"MoE: {key} must be a positive int, got {value!r}.")
    if num_experts % world and world % num_experts:
        fits = [w for w in range(1, num_experts + 1) if num_experts % w == 0]
        raise ValueError(
            f"MoE: num_experts={num_experts} does not split evenly over the {world} ranks "
            f"of the expert-parallel group. Use a multiple of {world} experts, a number "
            f"that divides {world} (more ranks than experts: each expert sliced over "
            f"them, Tutel's EP+DP+MP), or a group whose size divides {num_experts} (one of {fits})."
        )
    if world <= num_experts and expert_slices is not None:
        raise ValueError(
            f"expert_slices={expert_slices!r} slices experts over more ranks than experts; here "
            f"{num_experts} experts fit whole on {world} ranks. Leave it at None."
        )
    if world % smart_group_size:
        fits = [g for g in range(1, world + 1) if world % g == 0]
        raise ValueError(
            f"MoE: smart_group_size={smart_group_size} does not divide the {world} ranks of the "
            f"expert-parallel group; choose one of {fits}."
        )
    if dynamic_capacity and dropless:
        raise ValueError(
            "MoE: dynamic_capacity=True already sets the capacity from the load (at most "
            "capacity_factor's); dropless=True never limits it. Choose one."
        )


def check_tokens(x, d_model: int, dtype, name: str) -> None:
    """A forward's input: vectors of ``d_model`` in the weights' ``dtype`` (or under autocast)."""
    if x.dim() == 0 or x.shape[-1] != d_model:
        raise ValueError(f"MoE {name!r} expects tokens of shape (..., d_model={d_model}), got {tuple(x.shape)}.")
    if not x.is_floating_point() or (x.dtype != dtype and not torch.is_autocast_enabled(x.device.type)):
        hint = (
            "token ids go through an embedding first (nn.Embedding), the MoE layer takes its vectors"
            if not x.is_floating_point()
            else f"convert one to the other: x.to({dtype}) or layer.to({x.dtype})"
        )
        raise TypeError(f"MoE {name!r} expects {dtype} tokens, like its weights, got {x.dtype}: {hint}.")
