"""What the simulator adds for a context-parallel layout: the counts its theory needs.

`simulate(..., cp=c)` runs the toolkit's own ring attention or Ulysses on the fake group exactly as on real ranks:
every pass of keys and values is a send to the next rank of the cp group and a receive from the previous one,
through the door, asynchronous, issued before the block in hand is attended and waited for after it (so the cost
model sees the overlap as the rank issued it, and prices each pass on the link between the two ranks: NVLink
inside a node, the network between nodes). This file only describes the layout after wrapping, and the bytes
`toolkit.memory.context_formulas` predicts for it (`Simulation.theory` adds them).
"""

from __future__ import annotations

from ..memory.context_formulas import ring_bytes_per_layer, ulysses_bytes_per_layer
from ..parallel.checkpointing import period


def describe(model, options: dict, batch: int, seq_len: int, world_size: int, micro_batches: int = 1) -> dict | None:
    """{"cp", "attention", "dp", "bytes"} of a wrapped context-parallel model (None without cp); a step of
    `micro_batches` reduces each one's loss over the cp group."""
    context = getattr(model, "context", None)
    if context is None:
        return None
    cp, tp, pp = context.cp.size, options.get("tp", 1), options.get("pp", 1)
    config = getattr(getattr(model, "module", model), "config", None)
    found = {"cp": cp, "attention": context.attention, "dp": world_size // (cp * tp * pp), "bytes": None}
    if config is not None and hasattr(config, "d_model") and pp == 1:
        value = 2 if options.get("mixed_precision") else 4
        formula = ring_bytes_per_layer if context.attention != "ulysses" else ulysses_bytes_per_layer
        kv_hidden = getattr(config, "kv_width", config.d_model)  # grouped-query attention: compact K and V
        per_layer = formula(batch, seq_len, config.d_model, cp, tp=tp, bytes_per_value=value, kv_hidden=kv_hidden)
        k = period(options.get("activation_checkpointing", False))
        again = config.n_layer // k * per_layer["forward"] if k else 0  # the recomputed blocks' forward again
        loss_value = 4 if tp > 1 else value  # the vocabulary-parallel loss is fp32; else in the compute dtype
        loss = 2 * (cp - 1) * loss_value // cp * micro_batches  # the loss's all-reduce over the cp group
        found["bytes"] = config.n_layer * per_layer["total"] + again + loss
    return found
