"""The theory the lessons check the measurements against.

Pure functions, no torch: bytes of model states under ZeRO, elements and bytes a collective puts on the wire, an
alpha-beta time model, activation memory, and DeepSpeed's own estimators (FSDP's peak parameters and cross-host
traffic are in fsdp_formulas.py, importable from here too).

Notation (as in the ZeRO paper): Ψ parameters, N data-parallel ranks, K bytes of optimizer state per parameter
(mixed-precision Adam: fp32 master weights 4 + momentum 4 + variance 4 = 12). Sizes are plain numbers (floats where a
shard is a fraction); 1 GB = 1e9 bytes.
"""

from __future__ import annotations

from .fsdp_formulas import flat_padding, fsdp_cross_host_traffic, fsdp_peak_params  # noqa: F401 - one import path
from .inputs import (  # noqa: F401 - the
    COLLECTIVES,
    FSDP_SHARDING,
    STRATEGIES,
    ZERO_STAGES,
    _check_choice,
    _check_count,  # constants: toolkit.memory's
    _check_world,
)

# --- model states under ZeRO --------------------------------------------------------------------


def model_states_breakdown(
    num_params: float,
    world_size: int = 1,
    stage: int = 0,
    *,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    optimizer_multiplier: float = 12,
) -> dict[str, float]:
    """Bytes per rank of parameters, gradients and optimizer states under ZeRO ``stage``.

    Plain data parallelism (stage 0) replicates everything: (2 + 2 + K)Ψ on every rank.
    Each ZeRO stage partitions one more of the three over the N ranks:
    stage 1 the optimizer states, stage 2 also the gradients, stage 3 also the parameters.
    """
    _check_count("num_params", num_params)
    _check_world("world_size", world_size)
    _check_choice("ZeRO stage", stage, ZERO_STAGES)
    for name, value in (
        ("param_bytes", param_bytes),
        ("grad_bytes", grad_bytes),
        ("optimizer_multiplier", optimizer_multiplier),
    ):
        _check_count(name, value)
    n = world_size
    return {
        "params": param_bytes * num_params / (n if stage >= 3 else 1),
        "grads": grad_bytes * num_params / (n if stage >= 2 else 1),
        "optimizer": optimizer_multiplier * num_params / (n if stage >= 1 else 1),
    }


def model_states(
    num_params: float,
    world_size: int = 1,
    stage: int = 0,
    *,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    optimizer_multiplier: float = 12,
) -> float:
    """Bytes per rank of model states (parameters + gradients + optimizer) under ZeRO ``stage``.

    stage 0: (2+2+K)Ψ    stage 1: (2+2)Ψ + KΨ/N    stage 2: 2Ψ + (2+K)Ψ/N    stage 3: (2+2+K)Ψ/N
    """
    parts = model_states_breakdown(
        num_params,
        world_size,
        stage,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        optimizer_multiplier=optimizer_multiplier,
    )
    return sum(parts.values())


def deepspeed_zero2_estimate(num_params: float, world_size: int) -> float:
    """DeepSpeed's ZeRO-2 GPU estimate (no offload): 2Ψ + 18Ψ/N bytes.

    18 = 2 (fp16 grads) + 4 (fp32 grads) + 4 (fp32 params) + 8 (Adam states): the
    implementation keeps an fp32 gradient buffer that the textbook 16Ψ leaves out.
    (Older DeepSpeed releases printed 4Ψ + 16Ψ/N.)
    """
    _check_count("num_params", num_params)
    _check_world("world_size", world_size)
    return 2 * num_params + 18 * num_params / world_size


def deepspeed_zero3_estimate(num_params: float, largest_layer_params: float, world_size: int) -> float:
    """DeepSpeed's ZeRO-3 GPU estimate (no offload): 4L + 18Ψ/N bytes.

    18Ψ/N is the rank's shard of everything; 4L leaves room for the largest layer
    (L parameters) gathered whole while it computes.
    """
    _check_count("num_params", num_params)
    _check_count("largest_layer_params", largest_layer_params)
    _check_world("world_size", world_size)
    return 4 * largest_layer_params + 18 * num_params / world_size


# --- communication volume -----------------------------------------------------------------------


def ring_reduce_scatter_bytes(nbytes: float, n: int) -> float:
    """Bytes each rank sends in a ring reduce-scatter of an ``nbytes`` tensor: (n-1)/n · nbytes.

    n-1 steps, each passing one 1/n chunk to the neighbour.
    """
    _check_count("nbytes", nbytes)
    _check_world("n", n)
    return (n - 1) / n * nbytes


def ring_all_gather_bytes(nbytes: float, n: int) -> float:
    """Bytes each rank sends in a ring all-gather whose gathered output is ``nbytes``: (n-1)/n · nbytes."""
    _check_count("nbytes", nbytes)
    _check_world("n", n)
    return (n - 1) / n * nbytes


def ring_all_reduce_bytes(nbytes: float, n: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``nbytes``: 2(n-1)/n · nbytes.

    A ring all-reduce is a reduce-scatter followed by an all-gather; the volume is
    (nearly) independent of n, which is why data parallelism scales.
    """
    return ring_reduce_scatter_bytes(nbytes, n) + ring_all_gather_bytes(nbytes, n)


def communication_per_step(
    num_params: float, world_size: int, strategy: str, *, accumulation: int = 1, no_sync: bool = True
) -> float:
    """Elements each rank sends per training step with ring collectives.

    dp, ddp, zero1, zero2: one all-reduce of the gradients (or its two halves:
    reduce-scatter of gradients, all-gather of updated parameters) = 2Ψ(N-1)/N.
    zero3, fsdp: parameters all-gathered in forward and again in backward, gradients
    reduce-scattered = 3Ψ(N-1)/N, 1.5x data parallelism. local: nothing.
    A step of `accumulation` micro-batches: zero3 and fsdp gather in every micro-batch's forward and
    backward; the gradients are reduced once a step where the strategy can hold them back (`no_sync`:
    dp, ddp, zero1 and fsdp keep whole gradients until the last micro-batch), every micro-batch where it
    cannot (zero2 and zero3 keep only a slice) or is not asked to (no_sync=False: Composer's FSDP, DeepSpeed).
    Multiply by bytes per element for bytes.
    """
    _check_count("num_params", num_params)
    _check_world("world_size", world_size)
    _check_choice("strategy", strategy, STRATEGIES)
    _check_world("accumulation", accumulation)
    gathers = {"local": 0, "dp": 0, "ddp": 0, "zero1": 1, "zero2": 1}.get(strategy, 2 * accumulation)
    reduction = {"local": 0, "dp": 2, "ddp": 2}.get(strategy, 1)  # an all-reduce is two passes of the ring
    passes = gathers + gradient_reductions(strategy, accumulation, no_sync) * reduction
    return passes * num_params * (world_size - 1) / world_size


def gradient_reductions(strategy: str, accumulation: int = 1, no_sync: bool = True) -> int:
    """How many times a step of `accumulation` micro-batches reduces its gradients: once where the strategy's
    no_sync() holds them back to the last micro-batch (dp, ddp, zero1 and fsdp keep whole gradients), else each time."""
    return 1 if no_sync and strategy in ("dp", "ddp", "zero1", "fsdp") else accumulation


def bytes_on_wire(op: str, nbytes: float, world_size: int) -> float:
    """Bytes each rank sends for collective ``op`` on an ``nbytes`` buffer (see ``alpha_beta_time``)."""
    return _steps_and_bytes(op, nbytes, world_size)[1]


def _steps_and_bytes(op: str, nbytes: float, n: int):
    _check_choice("collective", op, COLLECTIVES)
    _check_count("nbytes", nbytes)
    _check_world("world_size", n)
    if n == 1:
        return 0, 0.0
    if op == "all_reduce":
        return 2 * (n - 1), ring_all_reduce_bytes(nbytes, n)
    if op == "broadcast":
        return n - 1, float(nbytes)  # pipelined along a chain: every link carries the whole buffer
    # reduce_scatter, all_gather: one chunk per step; all_to_all: one peer per step (pairwise exchange)
    return n - 1, (n - 1) / n * nbytes


def alpha_beta_time(op: str, nbytes: float, world_size: int, alpha: float, beta: float) -> float:
    """Seconds for collective ``op`` under the alpha-beta model: time = steps·alpha + bytes_on_wire·beta.

    alpha is the latency of one message (s), beta the time per byte (s/B, = 1/bandwidth).
    ``nbytes`` is the full tensor: the input of all_reduce / reduce_scatter / broadcast, the
    gathered output of all_gather, a rank's whole send buffer for all_to_all.

    all_reduce (ring)      2(N-1) steps, 2(N-1)/N · nbytes
    reduce_scatter (ring)   N-1 steps,   (N-1)/N · nbytes
    all_gather (ring)       N-1 steps,   (N-1)/N · nbytes
    broadcast (pipelined)   N-1 steps,   nbytes (large-message limit)
    all_to_all (pairwise)   N-1 steps,   (N-1)/N · nbytes
    """
    _check_count("alpha", alpha)
    _check_count("beta", beta)
    steps, wire = _steps_and_bytes(op, nbytes, world_size)
    return steps * alpha + wire * beta


# --- activations ---------------------------------------------------------------------------------


def activation_bytes(seq_len: int, batch: int, hidden: int, heads: int, layers: int = 1) -> float:
    """Activation bytes a transformer keeps for backward: s·b·h·(34 + 5·a·s/h) per layer.

    Korthikanti et al. 2022, 16-bit activations, no recomputation, no tensor parallelism.
    34·sbh is the linear part (inputs of matmuls, LayerNorms, GELU, dropout masks);
    5·a·s²·b is the attention scores, softmax and its dropout mask, quadratic in s.
    `activation_terms` gives the same number term by term, and for other models.
    """
    for name, value in (("seq_len", seq_len), ("batch", batch), ("hidden", hidden), ("heads", heads)):
        _check_world(name, value)
    _check_count("layers", layers)
    s, b, h, a = seq_len, batch, hidden, heads
    return layers * s * b * h * (34 + 5 * a * s / h)


def activation_terms(
    seq_len: int,
    batch: int,
    hidden: int,
    heads: int,
    *,
    bytes_per_value: float = 2,
    ffn_hidden: int | None = None,
    dropout: bool = True,
    fused_attention: bool = False,
    small_terms: bool = False,
    recompute_attention: bool = False,
) -> dict[str, float]:
    """Bytes one transformer layer keeps for backward, term by term (what each operation saves).

    With the defaults (16-bit values, dropout, attention that materializes its s x s scores, an MLP
    of width 4h) the terms add up to Korthikanti et al.'s s·b·h·(34 + 5·a·s/h) exactly. The switches
    describe a model the paper does not:

    bytes_per_value  2 for 16-bit activations, 4 for fp32 (dropout masks stay 1 byte)
    ffn_hidden       the MLP's hidden width (default 4h)
    dropout          False: no dropout masks, no dropped-out copy of the scores
    fused_attention  True: a fused kernel (FlashAttention, torch's scaled_dot_product_attention) never
                     stores the s x s scores; it keeps its output and a log-sum-exp per row (fp32)
    small_terms      True: also the terms the paper neglects, the LayerNorms' mean and 1/std per row
                     (in the activations' dtype, as torch's CPU kernel keeps them; CUDA keeps fp32)
                     and the fused kernel's log-sum-exp, so the count is exact
    recompute_attention  True: the core attention recomputed (Megatron's selective): no scores or log-sum-exp kept
    """
    for name, value in (("seq_len", seq_len), ("batch", batch), ("hidden", hidden), ("heads", heads)):
        _check_world(name, value)
    _check_count("bytes_per_value", bytes_per_value, 1)
    s, b, h, a, p = seq_len, batch, hidden, heads, bytes_per_value
    f = 4 * h if ffn_hidden is None else ffn_hidden
    _check_world("ffn_hidden", f)
    sbh, scores = s * b * h, 0 if fused_attention or recompute_attention else a * s * s * b  # s x s, stored
    terms = {
        "LayerNorm inputs (2)": 2 * p * sbh,
        "QKV matmul input": p * sbh,
        "Q, K, V": 3 * p * sbh,
        "attention output (projection input)": p * sbh,
        "MLP input": p * sbh,
        "GELU input": p * s * b * f,
        "GELU output (second matmul input)": p * s * b * f,
        "dropout masks (2, 1 byte)": 2 * sbh if dropout else 0,
        "softmax output": p * scores,
        "softmax dropout mask (1 byte)": scores if dropout else 0,
        "softmax dropout output": p * scores if dropout else 0,
    }
    if small_terms:
        terms["LayerNorm mean and 1/std (2)"] = 2 * 2 * p * s * b
        terms["attention log-sum-exp (fp32)"] = 4 * a * s * b if fused_attention and not recompute_attention else 0
    return terms


__all__ = [
    "model_states",
    "model_states_breakdown",
    "deepspeed_zero2_estimate",
    "deepspeed_zero3_estimate",
    "communication_per_step",
    "gradient_reductions",
    "ring_all_reduce_bytes",
    "ring_reduce_scatter_bytes",
    "ring_all_gather_bytes",
    "bytes_on_wire",
    "alpha_beta_time",
    "fsdp_peak_params",
    "flat_padding",
    "fsdp_cross_host_traffic",
    "activation_bytes",
    "activation_terms",
    "ZERO_STAGES",
    "STRATEGIES",
    "COLLECTIVES",
    "FSDP_SHARDING",
]
