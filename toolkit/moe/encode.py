"""Tutel's fast encode and decode: tokens into their experts' buffers by index, not by one-hot einsum.

GShard's formulation, which the first MoE codes ran as written, moves tokens with dense masks: a
(T, E, C) one-hot mask says which slot of which expert each token takes, and

    encode   dispatched (E, C, d) = einsum("tec,td->ecd", dispatch_mask, x)
    decode   y (T, d)             = einsum("tec,ecd->td", combine_weights, expert_out)

Each mask holds T*E*C numbers; with C = k*f*T/E that is k*f*T^2, quadratic in the tokens, and each
einsum spends T*E*C*d multiply-adds, nearly all of them on zeros. Tutel's fast encode/decode (fused
GPU kernels there, "90% less memory" in its slides) writes each kept (token, choice) to its slot
directly and reads it back the same way: O(T*k*d) work, no mask. ``encode_index`` / ``decode_index``
are that idea in plain torch (an index_add into the flat (E*C, d) buffer, a gather back); the two
``*_einsum`` functions are GShard's, for the lesson to measure against. The layer itself goes one step
further: only kept rows travel (``MoE.sort_by_destination``, ``weighted_sum``), no (E, C, d) buffer.
All four are differentiable (with respect to x, the expert outputs and the gate weights).
"""

from __future__ import annotations

import torch

from .gates import Routing


def encode_einsum(routing: Routing, x: torch.Tensor) -> torch.Tensor:
    """(T, d) tokens -> (E, C, d) expert buffers through the (T, E, C) one-hot dispatch mask."""
    return torch.einsum("tec,td->ecd", routing.dispatch_mask().to(x.dtype), x)


def decode_einsum(routing: Routing, expert_out: torch.Tensor) -> torch.Tensor:
    """(E, C, d) expert outputs -> (T, d): each token's gate-weighted sum, through (T, E, C) weights."""
    return torch.einsum("tec,ecd->td", routing.combine_weights().to(expert_out.dtype), expert_out)


def _kept(routing: Routing):
    """(slot in the flat E*C buffer, token, choice) of every kept choice."""
    where = routing.buffer_index()
    token, choice = routing.kept.nonzero(as_tuple=True)
    return where[token, choice], token, choice


def encode_index(routing: Routing, x: torch.Tensor) -> torch.Tensor:
    """Tutel's fast encode: each kept choice's token copied into its slot, (E, C, d), no mask."""
    slot, token, _ = _kept(routing)
    E, C = routing.num_experts, routing.capacity
    return x.new_zeros(E * C, x.shape[-1]).index_add(0, slot, x[token]).reshape(E, C, -1)


def decode_index(routing: Routing, expert_out: torch.Tensor) -> torch.Tensor:
    """Tutel's fast decode: each kept choice's slot read back, times its gate weight, added to its token."""
    slot, token, choice = _kept(routing)
    rows = expert_out.reshape(-1, expert_out.shape[-1])[slot]
    weight = routing.gate_weight[token, choice].to(rows.dtype)
    return rows.new_zeros(routing.num_tokens, rows.shape[-1]).index_add(0, token, rows * weight[:, None])
