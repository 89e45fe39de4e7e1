"""Mixture of Experts: the gate (moe/gates.py), then the expert-parallel layer built on it."""

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
