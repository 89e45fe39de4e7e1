"""The MoE layer's systems options (FasterMoE, Tutel): which names exist and which combinations can work."""

from __future__ import annotations

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
