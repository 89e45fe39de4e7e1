"""The theory of context parallelism: activations per rank, and what the ring and Ulysses send per layer.

Pure functions, no torch, as `formulas.py`. Notation: cp context-parallel ranks, t tensor-parallel ranks, b
sequences, s tokens per sequence (the whole sequence), h hidden size, a heads, p bytes per activation value.

Activations. A cp rank holds s/cp tokens of every sequence, and everything a layer keeps is per token except
attention's s x s scores, which a fused kernel never stores (it keeps its output and a log-sum-exp per row). So
a layer on a cp rank keeps what one process keeps for a sequence of s/cp tokens: Korthikanti's
s·b·h·(34 + 5·a·s/h) becomes (s/cp)·b·h·34 with fused attention, a cp-fold saving that, unlike tensor
parallelism's, reaches across nodes. (`cp_activation_terms`: the terms at s/cp, under tensor parallelism too.)

Bytes per layer, per rank (K and V of the whole sequence: 2·b·s·h/t values on a tensor-parallel rank):

    ring, forward    each rank passes its block of K and V on cp-1 times:      (cp-1)/cp · 2·b·s·h/t · p
    ring, backward   K and V go round again, and their gradient with them
                     (accumulated, and sent, in fp32: g bytes per value):       (cp-1)/cp · 2·b·s·h/t · (p + g)
    Ulysses, each    an all-to-all of q, k, v (3 tensors of b·(s/cp)·h/t) and one of the output, each rank
    pass             keeping 1/cp of what it holds:                             (cp-1)/cp · 4·b·(s/cp)·h/t · p

The ring's bytes per rank stay the same as cp grows (cp-1 messages of a block 1/cp the size), and only pass
between neighbours; Ulysses' shrink as 1/cp but are all-to-all, on the critical path.
"""

from __future__ import annotations

from .formulas import _check_count, _check_world, activation_terms


def cp_activation_terms(
    seq_len: int,
    batch: int,
    hidden: int,
    heads: int,
    cp: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    **options,
) -> dict[str, float]:
    """What a layer keeps on one cp rank: `activation_terms` (or `tp_activation_terms` with tp > 1) for s/cp
    tokens. `options` are activation_terms' switches (fused_attention=True: what ring attention keeps)."""
    _check_world("cp", cp)
    if seq_len % cp:
        raise ValueError(f"seq_len={seq_len} does not split over cp={cp} ranks.")
    if tp > 1 or sequence_parallel:
        from .tensor_formulas import tp_activation_terms

        return tp_activation_terms(
            seq_len // cp, batch, hidden, heads, tp, sequence_parallel=sequence_parallel, **options
        )
    return activation_terms(seq_len // cp, batch, hidden, heads, **options)


def ring_bytes_per_layer(
    batch: int,
    seq_len: int,
    hidden: int,
    cp: int,
    *,
    tp: int = 1,
    bytes_per_value: float = 2,
    gradient_bytes: float = 4,
    kv_hidden: int | None = None,
) -> dict[str, float]:
    """Bytes one rank sends per layer for ring attention: {"forward", "backward", "total"}. kv_hidden: the width
    of K (and of V), n_kv_head x head_dim under grouped-query attention, which the ring passes compact (None:
    hidden)."""
    for name, value in (("cp", cp), ("tp", tp)):
        _check_world(name, value)
    _check_count("bytes_per_value", bytes_per_value, 1)
    kv_width = hidden if kv_hidden is None else kv_hidden
    kv = 2 * batch * seq_len * kv_width / tp  # K and V of the whole sequence on one tensor-parallel rank (values)
    forward = (cp - 1) / cp * kv * bytes_per_value
    backward = (cp - 1) / cp * kv * (bytes_per_value + gradient_bytes)
    return {"forward": forward, "backward": backward, "total": forward + backward}


def ulysses_bytes_per_layer(
    batch: int,
    seq_len: int,
    hidden: int,
    cp: int,
    *,
    tp: int = 1,
    bytes_per_value: float = 2,
    kv_hidden: int | None = None,
) -> dict[str, float]:
    """Bytes one rank sends per layer for Ulysses' all-to-alls (q, k, v in, the output back): {"forward",
    "backward", "total"}; backward runs the same all-to-alls in reverse. kv_hidden: as for the ring."""
    for name, value in (("cp", cp), ("tp", tp)):
        _check_world(name, value)
    _check_count("bytes_per_value", bytes_per_value, 1)
    widths = 2 * hidden + 2 * (hidden if kv_hidden is None else kv_hidden)  # q and the output; k and v
    held = batch * seq_len / cp * widths / tp * bytes_per_value  # q, k, v and the output on this rank
    forward = (cp - 1) / cp * held
    return {"forward": forward, "backward": forward, "total": 2 * forward}


__all__ = ["cp_activation_terms", "ring_bytes_per_layer", "ulysses_bytes_per_layer"]
