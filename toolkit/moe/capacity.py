"""Capacity: how many (token, choice) rows one expert accepts, and where the systems differ on it.

All-to-all needs fixed shapes (Tutel, DeepSpeed and GShard send a padded (E, C, d) buffer), so every
expert gets C slots; rows beyond C are dropped (they skip the layer through the residual connection).
With perfect balance each expert receives k*T/E rows of the T tokens a rank routes with top-k over E
experts; the capacity factor f is the slack on top:

    here (GShard)   C = max(ceil(k * f * T / E), min_capacity)          min_capacity: 1 (DeepSpeed: 4)
    Tutel           C = k * int(f * ceil(T / E)), rounded up to a multiple of ``alignment`` (default 1)

The two round differently: T = 10, E = 4, k = 2, f = 1.25 gives 7 here and 2 * int(1.25 * 3) = 6 in
Tutel (it rounds T/E up, then f * that down); T = 12, E = 8, k = 1, f = 1.5: 3 here, int(1.5 * 2) = 3
there. ``tutel_capacity`` computes Tutel's, for comparison. The toolkit keeps GShard's form (the
lessons' formula; every rank routing the same T computes the same C without a collective).

Dynamic capacity (Tutel's adaptive capacity, ``MoE(dynamic_capacity=True)``): each step C is the fullest
expert's count, agreed by all ranks (all-reduce MAX), never more than the bound f gives. Tutel spells
it with the factor's sign: ``capacity_factor=-f`` (bounded by f), ``0`` (no bound); here the sign is an
error that says so (``dynamic_capacity=True, capacity_factor=f``; ``dropless=True`` for no bound). One
more difference: Tutel takes the global maximum first and bounds it after, with this rank's T; here
each rank bounds its own count first and the ranks then agree on the maximum. The two agree whenever the
ranks route the same number of tokens (the bound is then the same everywhere); with uneven T Tutel's
ranks could end with different capacities, which its equal-shape all-to-all forbids, so it assumes
equal T. The layer (``moe/layer.py``) applies dynamic capacity; this file holds the arithmetic, and the
ranks' agreement on one capacity (``agreed_capacity``).
"""

from __future__ import annotations

import math
import numbers

import torch

from .. import comm


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float, min_capacity: int = 1) -> int:
    """Slots per expert buffer: ``max(ceil(k * f * T / E), min_capacity)``.

    With perfect balance each expert receives k*T/E tokens; ``capacity_factor`` f is the slack on top.
    The result depends only on these numbers, so every rank that routes the same number of tokens
    computes the same C and the all-to-all shapes agree without a collective.

    A tiny tolerance absorbs float error (1 * 1.1 * 10 / 11 is 1.0000000000000002 in floating point
    and must give 1, not 2).
    """
    if not _is_int(num_tokens) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an int >= 0 (tokens routed on this rank), got {num_tokens!r}.")
    if not _is_int(num_experts) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}.")
    if not _is_int(top_k) or top_k < 1:
        raise ValueError(f"top_k must be an int >= 1 (experts per token), got {top_k!r}.")
    if top_k > num_experts:
        raise ValueError(
            f"top_k={top_k} is larger than num_experts={num_experts}: a token cannot pick "
            f"more distinct experts than exist. Use top_k <= {num_experts}."
        )
    if _is_real(capacity_factor) and capacity_factor <= 0:
        bound = (
            f"dynamic_capacity=True, capacity_factor={-capacity_factor!r} (at most that factor's C)"
            if capacity_factor < 0
            else "dropless=True (no bound)"
        )
        raise ValueError(
            f"capacity_factor={capacity_factor!r}: a factor <= 0 is Tutel's spelling of dynamic "
            f"capacity (C = the fullest expert's count each step, bounded by -f; 0: no bound). Here "
            f"write {bound}. A fixed capacity needs f > 0 (1.0 = exactly the balanced load, 1.25 "
            f"is common)."
        )
    if not _is_real(capacity_factor):
        raise ValueError(
            f"capacity_factor must be a finite number > 0 (1.0 = exactly the balanced "
            f"load, 1.25 is common), got {capacity_factor!r}. For no dropping at all, "
            f"use dropless=True instead of a huge factor."
        )
    if not _is_int(min_capacity) or min_capacity < 0:
        raise ValueError(f"min_capacity must be an int >= 0, got {min_capacity!r}.")
    c = math.ceil(int(top_k) * float(capacity_factor) * int(num_tokens) / int(num_experts) - 1e-9)
    return max(c, int(min_capacity))


def tutel_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float, alignment: int = 1) -> int:
    """Tutel's static capacity (``tutel.impls.fast_dispatch.extract_critical`` for capacity_factor > 0):
    k * int(f * ceil(T / E)), rounded up to a multiple of ``alignment``. For comparison; the layer uses
    ``capacity``."""
    c = int(top_k) * int(float(capacity_factor) * ((int(num_tokens) + num_experts - 1) // num_experts))
    return c + (-c) % int(alignment)


def agreed_capacity(capacity: int, group, device) -> int:
    """The largest of every rank's ``capacity`` (an all-reduce MAX over ``group``): the one capacity that
    dropless and dynamic capacity need, so that every rank agrees on each all-to-all's shapes."""
    agreed = torch.tensor([capacity], device=device)
    comm.all_reduce(agreed, op="max", group=group)
    return int(agreed.item())
