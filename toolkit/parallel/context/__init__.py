"""Context parallelism: the sequence split over `cp` ranks, attention across them.

    model, opt = toolkit.parallel.wrap(tiny_gpt(), "fsdp", cp=2)                     # ring attention, zigzag
    model, opt = toolkit.parallel.wrap(tiny_gpt(), "ddp", cp=2, cp_attention="ulysses")

At 32k-128k tokens the activations of a layer outgrow every other memory term (Korthikanti's s·b·h·(34 + 5as/h)
grows with s, and its attention term with s²). Tensor and sequence parallelism divide them by t, but only up to
a node; context parallelism divides them by cp, across nodes, by giving each rank s/cp of every sequence. Only
attention mixes tokens, so only attention must talk. Read in this order:

    sequence.py        which tokens each rank holds: contiguous, or zigzag (chunks i and 2cp-1-i) for causal balance
    merge.py           the online-softmax merge of two partial attentions (the log-sum-exp rule)
    block.py           one block's attention with its log-sum-exp, and its backward (the fused kernel)
    ring.py            the ring: pass a block to the next rank while computing on this one
    ring_attention.py  ring attention: cp steps forward and backward, which part of each block a rank attends
    ulysses.py         DeepSpeed-Ulysses: all-to-all to a head split, attention, all-to-all back
    operators.py       the cp group; the loss averaged over cp ranks; the logits gathered
    model.py           a model made context-parallel in place (its attention, its positions, its ends)

`parallelize` is a step of `toolkit.parallel.compose`, after tensor parallelism and before the pipeline: the
data-parallel strategy then reduces over dp x cp (the cp ranks hold the same parameters and see different
tokens), and learns nothing else of cp.
"""

from __future__ import annotations

from .merge import merge
from .model import ATTENTIONS, ContextParallel, attention_modules, parallelize
from .operators import CPGroup
from .ring import Ring
from .ring_attention import ring_attention
from .sequence import SequenceSplit
from .ulysses import ulysses_attention

__all__ = [
    "ATTENTIONS",
    "CPGroup",
    "ContextParallel",
    "Ring",
    "SequenceSplit",
    "attention_modules",
    "merge",
    "parallelize",
    "ring_attention",
    "ulysses_attention",
]
