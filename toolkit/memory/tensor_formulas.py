"""The theory of tensor parallelism (Megatron-LM, Korthikanti et al. 2022): model states, bytes, activations.

Pure functions, no torch, as `formulas.py`. Notation: t tensor-parallel ranks, dp data-parallel replicas,
b sequences per replica, s tokens per sequence, h hidden size, a heads, L layers, V vocabulary, p bytes per
activation value (4 in fp32, 2 with mixed precision).

Model states. A tensor-parallel rank holds 1/t of every split weight and all of every replicated one, so
with Ψ_split split and Ψ_rep replicated parameters its model is Ψ_split/t + Ψ_rep, and a data-parallel
strategy over dp then treats that as its Ψ: ZeRO stage k divides the kinds it shards by dp.

Bytes. Each split layer pair talks in the critical path: per block two all-reduces of the (b, s, h)
activation forward (g) and two backward (f); the embedding's g and the head's f add one each; the
vocabulary-parallel loss three all-reduces of b·s fp32 numbers. Sequence parallelism turns each into a
reduce-scatter and an all-gather (the same bytes: a ring all-reduce is the two), and adds one all-gather per
column-parallel layer in backward (its input is gathered again rather than stored), plus the all-reduces of
the sequence-parallel parameters' gradients (layer norms, row-parallel biases: 6h per block, 2h for ln_f).
The embedding's g becomes a reduce-scatter alone (each rank keeps its s/t positions: half the bytes), and
its backward all-gathers the activation's gradient and the position table's (s·h: each rank added its own
positions).

Activations per layer (Korthikanti et al. 2022, 16-bit, with dropout, scores stored):
    no tensor parallelism     s·b·h·(34 + 5·a·s/h)
    tensor parallelism        s·b·h·(10 + 24/t + 5·a·s/(h·t))     LN inputs, matmul inputs of the two
                                                                 column layers and dropout masks stay whole
    + sequence parallelism    s·b·h·(34/t + 5·a·s/(h·t))          everything split
    + selective recomputation the 5·a·s/(h·t) term gone            the core attention recomputed from Q, K, V
`tp_activation_terms` splits `formulas.activation_terms` term by term the same way, so the toolkit GPT
(no dropout, fused attention) is predicted to the byte.
"""

from __future__ import annotations

from .formulas import _check_count, _check_world, activation_terms, model_states_breakdown


# --- parameters and model states ---------------------------------------------------------------------
def gpt_parameter_split(
    vocab: int,
    seq_len: int,
    layers: int,
    hidden: int,
    ffn_hidden: int | None = None,
    tied: bool = True,
    kv_hidden: int | None = None,
) -> dict[str, int]:
    """{"split", "replicated"} parameter counts of the toolkit GPT under its default plan (`tensor/gpt.py`).

    Split: the embedding (and an untied head), Q/K/V weights and biases, the attention output and second MLP
    weights, the first MLP's weight and bias. Replicated: position embeddings, layer norms, the biases added
    after a row-parallel layer's reduction. kv_hidden: the width of K (and of V), n_kv_head x head_dim under
    grouped-query attention (None: hidden, one key-value head per query head).
    """
    for name, value in (("vocab", vocab), ("seq_len", seq_len), ("layers", layers), ("hidden", hidden)):
        _check_world(name, value)
    h, f = hidden, 4 * hidden if ffn_hidden is None else ffn_hidden
    qkv = h + 2 * (h if kv_hidden is None else kv_hidden)  # the fused projection's output features
    per_block_split = (h * qkv + qkv) + h * h + (h * f + f) + f * h
    per_block_rep = 4 * h + 2 * h  # two layer norms (weight, bias), two row-parallel biases
    split = vocab * h * (1 if tied else 2) + layers * per_block_split
    replicated = seq_len * h + layers * per_block_rep + 2 * h  # + ln_f
    return {"split": split, "replicated": replicated}


def tp_model_states(
    split: float,
    replicated: float,
    tp: int,
    dp: int = 1,
    stage: int = 0,
    *,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    optimizer_multiplier: float = 12,
) -> dict[str, float]:
    """Bytes per rank of parameters, gradients and optimizer states: (Ψ_split/t + Ψ_rep) under ZeRO `stage` over dp.

    fsdp is stage 3 (its fp32 shards: param_bytes=4, grad_bytes=4, optimizer_multiplier=8)."""
    _check_count("split", split)
    _check_count("replicated", replicated)
    _check_world("tp", tp)
    return model_states_breakdown(
        split / tp + replicated,
        dp,
        stage,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        optimizer_multiplier=optimizer_multiplier,
    )


# --- bytes per step ------------------------------------------------------------------------------------
def tp_collectives(
    batch: int,
    seq_len: int,
    hidden: int,
    layers: int,
    tp: int,
    *,
    sequence_parallel: bool = False,
    bytes_per_value: float = 4,
    recompute: bool | int = False,
    comm_overlap: bool = False,
) -> dict[str, list]:
    """The tensor-parallel collectives of one training step of the toolkit GPT: {op: [message bytes, ...]}.

    A message's bytes are the collective's full tensor (an all-gather's output, a reduce-scatter's input). recompute
    (activation checkpointing; a whole number k: every k-th block): backward runs a checkpointed block's forward
    again, as far as the last tensor it needs (torch's non-reentrant checkpoint stops there): the attention's g once
    more (its output feeds ln_2, whose input backward needs) but not the MLP's (its output is only added to the
    residual); under sequence parallelism the attention's all-gather and reduce-scatter and the MLP's all-gather
    (fc's output feeds GELU). comm_overlap (`tp_comm_overlap`, with sequence parallelism): the same messages, each a
    ring of passes; recomputed, the MLP's reduce-scatter runs again too (its ring is one autograd Function with the
    GEMM whose input backward needs, which the checkpoint cannot stop inside)."""
    for name, value in (("batch", batch), ("seq_len", seq_len), ("hidden", hidden), ("tp", tp)):
        _check_world(name, value)
    _check_count("layers", layers)
    act = batch * seq_len * hidden * bytes_per_value  # one (b, s, h) activation
    loss = [batch * seq_len * 4] * 3  # max, target logit, sum of exps: fp32
    again = layers // int(recompute) if recompute else 0  # blocks whose forward backward runs again
    if not sequence_parallel:
        return {"all_reduce": [act] * (4 * layers + 2 + again) + loss, "all_gather": [], "reduce_scatter": []}
    params = [hidden * bytes_per_value] * (6 * layers + 2)  # sequence-parallel gradients, one message each
    positions = [seq_len * hidden * bytes_per_value]  # the position table's T/t-row gradients, gathered
    return {
        "all_reduce": loss + params,  # loss; parameters' gradients
        "all_gather": [act] * (6 * layers + 2 + 1 + 2 * again) + positions,  # per block 2 forward, 2 backward,
        "reduce_scatter": [act] * (4 * layers + 2 + again * (2 if comm_overlap else 1)),
    }  # 2 again; head 2; embedding 1 / embedding 1,
    # per block 2 + 2; head 1


def tp_bytes_per_step(
    batch: int,
    seq_len: int,
    hidden: int,
    layers: int,
    tp: int,
    *,
    sequence_parallel: bool = False,
    bytes_per_value: float = 4,
    recompute: bool | int = False,
    comm_overlap: bool = False,
) -> dict[str, float]:
    """Bytes each tensor-parallel rank sends per step for tensor parallelism, by op and "total" (ring
    accounting: an all-reduce sends 2(t-1)/t of its message, an all-gather or reduce-scatter (t-1)/t, as its
    t - 1 passes do under comm_overlap); recompute: under activation checkpointing (`tp_collectives`)."""
    calls = tp_collectives(
        batch,
        seq_len,
        hidden,
        layers,
        tp,
        sequence_parallel=sequence_parallel,
        bytes_per_value=bytes_per_value,
        recompute=recompute,
        comm_overlap=comm_overlap,
    )
    factor = {"all_reduce": 2 * (tp - 1) / tp, "all_gather": (tp - 1) / tp, "reduce_scatter": (tp - 1) / tp}
    out = {op: factor[op] * sum(sizes) for op, sizes in calls.items()}
    out["total"] = sum(out.values())
    return out


def tp_bytes_per_layer(
    batch: int, seq_len: int, hidden: int, tp: int, *, sequence_parallel: bool = False, bytes_per_value: float = 2
) -> float:
    """Bytes a rank sends per transformer layer per step: 4 all-reduces of b·s·h (2(t-1)/t each), or
    under sequence parallelism 4 reduce-scatters and 6 all-gathers ((t-1)/t each)."""
    act = batch * seq_len * hidden * bytes_per_value
    if sequence_parallel:
        return 10 * (tp - 1) / tp * act
    return 4 * 2 * (tp - 1) / tp * act


# --- activations ---------------------------------------------------------------------------------------
_WHOLE_UNDER_TP = (
    "LayerNorm inputs (2)",
    "QKV matmul input",
    "MLP input",
    "dropout masks (2, 1 byte)",
    "LayerNorm mean and 1/std (2)",
)


def tp_activation_terms(
    seq_len: int, batch: int, hidden: int, heads: int, tp: int, *, sequence_parallel: bool = False, **options
) -> dict[str, float]:
    """`formulas.activation_terms` on one tensor-parallel rank: the terms inside the split layers (Q, K, V,
    attention, GELU) divided by t; the others (layer norms, the column layers' inputs, dropout) whole, or
    divided by t too under sequence parallelism. `options` are activation_terms' switches."""
    _check_world("tp", tp)
    terms = activation_terms(seq_len, batch, hidden, heads, **options)
    return {k: v if k in _WHOLE_UNDER_TP and not sequence_parallel else v / tp for k, v in terms.items()}


def tp_activation_bytes(
    seq_len: int,
    batch: int,
    hidden: int,
    heads: int,
    tp: int,
    *,
    sequence_parallel: bool = False,
    layers: int = 1,
    recompute_attention: bool = False,
) -> float:
    """Korthikanti et al.'s closed forms per layer (16-bit, dropout, scores stored), times `layers`; with the core
    attention recomputed (their selective recomputation, equation 6) the 5·a·s/(h·t) term is gone."""
    s, b, h, a, t = seq_len, batch, hidden, heads, tp
    linear = 34 / t if sequence_parallel else 10 + 24 / t
    return layers * s * b * h * (linear + (0 if recompute_attention else 5 * a * s / (h * t)))


__all__ = [
    "gpt_parameter_split",
    "tp_model_states",
    "tp_collectives",
    "tp_bytes_per_step",
    "tp_bytes_per_layer",
    "tp_activation_terms",
    "tp_activation_bytes",
]
