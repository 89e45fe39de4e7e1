"""A Hugging Face model's own tensor-parallel plan, in the toolkit's words: tp= with no tp_plan.

transformers declares each model's plan beside its code (`base_model_tp_plan` in the config, `_tp_plan` on the
model once built: Llama's q, k, v, gate and up projections "colwise", o and down "rowwise", the embedding
"embedding_rowwise", the head "colwise_gather_output"). Those are the styles of `plan.py` under other names:

    colwise, rowwise          the same
    embedding_rowwise         "vocab" on an embedding: its rows (the vocabulary) split
    colwise_gather_output     "vocab" on a Linear head: logits split by vocabulary, then gathered for the loss

A pattern of the plan that matches no module of this model (Qwen2-MoE's dense-MLP entries when every layer is
a mixture of experts) is left out, as transformers leaves it; a style the toolkit has no layer for is refused.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch.nn as nn

STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "embedding_rowwise": "vocab",
    "colwise_gather_output": "vocab",
    "replicate": "replicate",
}


def own_plan(model: nn.Module) -> dict | None:
    """The model's own plan as a toolkit tp_plan, or None when it declares none."""
    declared = getattr(model, "_tp_plan", None)
    if not declared:
        return None
    unknown = {k: v for k, v in declared.items() if v not in STYLES}
    if unknown:
        raise ValueError(
            f"{type(model).__name__}'s own tensor-parallel plan (transformers' _tp_plan) uses styles the "
            f"toolkit has no layer for: {unknown}. Pass tp_plan= with the styles "
            f"{sorted(set(STYLES.values()))} "
            f"(its other entries translate as {STYLES})."
        )
    names = [n for n, _ in model.named_modules() if n]
    return {k: STYLES[v] for k, v in declared.items() if any(fnmatchcase(n, k) for n in names)}
