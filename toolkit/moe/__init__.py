"""Mixture of Experts: the gate (moe/gates.py), then the expert-parallel layer built on it."""

from .exchange import all_to_all
from .experts import Experts, gather_experts, is_expert
from .gates import (
    AUX_LOSSES,
    Routing,
    TopKGate,
    capacity,
    gshard_aux_loss,
    load_stats,
    router_z_loss,
    switch_aux_loss,
)
from .layer import MoE
from .load import merge_load
from .placement import Placement, choose_parallel, parallel_costs
from .plan import Plan
from .reference import reference_moe
from .shadow import ShadowChoice, choose_shadows, latency_imbalanced, latency_shadowed
from .topology import TopologyGate, topology_limit
