"""A tensor-parallel plan for any model: which layers split, and how, in torch's `parallelize_module` words.

    tp_plan = {"encoder.layers.*.linear1": "colwise",    # nn.Linear / HF Conv1D: output features split
               "encoder.layers.*.linear2": "rowwise",    # input features split, g after, bias once
               "embed": "vocab", "head": "vocab",        # embedding rows split; a Linear head: logits gathered
               "encoder.layers.*.self_attn": "replicate"}  # left whole on every rank (the default)

Keys are module names with shell-style wildcards (`fnmatch`: `*` matches any characters, dots too); every
key must match at least one module, and a split style only a Linear, a Hugging Face Conv1D or an
Embedding. What the plan cannot know is the model's own arithmetic: a "colwise" layer's output holds this
rank's features only, so whatever reads it must work on a slice (the "rowwise" layer after it; attention
would also need its head count divided by t, which is why the toolkit GPT has its own plan, `gpt.py`). A
"vocab" head gathers its logits (an all-gather of b·s·V) because a foreign model computes its loss on the
full logits; the toolkit GPT keeps them split. Sequence parallelism needs to know where a block's
sequence-local regions are, so it comes with the toolkit GPT's plan only.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch.nn as nn

from .embedding import VocabParallelEmbedding
from .linear import ColumnParallelLinear, RowParallelLinear, is_conv1d
from .operators import TPGroup

STYLES = ("colwise", "rowwise", "vocab", "replicate")


def _splittable(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, nn.Embedding)) or is_conv1d(module)


def resolve(model: nn.Module, plan) -> dict[str, str]:
    """{module name: style} for every module the plan names; every mistake is a ValueError that says so."""
    if not isinstance(plan, dict) or not plan:
        raise ValueError(
            f"tp_plan must be a non-empty dict {{module name pattern: style}} with styles {STYLES}, got {plan!r}."
        )
    modules = dict(model.named_modules())
    candidates = [n for n, m in modules.items() if n and _splittable(m)]
    chosen: dict[str, str] = {}
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or style not in STYLES:
            raise ValueError(
                f"tp_plan[{pattern!r}] = {style!r}: keys are module name patterns (str) and styles are one of {STYLES}."
            )
        names = [n for n in modules if n and fnmatchcase(n, pattern)]
        if not names:
            raise ValueError(
                f"tp_plan names {pattern!r}, which matches no module of this {type(model).__name__}. "
                f"Splittable modules (Linear, Conv1D, Embedding) are named like {candidates[:6]}."
            )
        for name in names:
            module = modules[name]
            if style != "replicate" and not _splittable(module):
                raise ValueError(
                    f"tp_plan[{pattern!r}] = {style!r} matches {name!r}, a {type(module).__name__}; only "
                    f"nn.Linear, Hugging Face's Conv1D and nn.Embedding can be split. "
                    f"{_instead(name, module, candidates)}, or plan it 'replicate'."
                )
            if style == "colwise" and _fused_qkv(name, module):
                raise ValueError(FUSED_QKV.format(pattern=pattern, name=name, cls=type(module).__name__))
            if isinstance(module, nn.Embedding) and style in ("colwise", "rowwise"):
                raise ValueError(f"tp_plan: {name!r} is an embedding; split it by vocabulary with 'vocab'.")
            if chosen.get(name, style) != style:
                raise ValueError(f"tp_plan gives {name!r} two styles, {chosen[name]!r} and {style!r}; give it one.")
            chosen[name] = style
    return chosen


FUSED_QKV = (
    "tp_plan[{pattern!r}] = 'colwise' splits {name!r}, a fused q/k/v projection ({cls} with 3 x its input "
    "features out): its output is [q | k | v], and a rank's contiguous slice of it would hold q of some heads "
    "and k of others, not q, k and v of the same heads; the model then cuts that slice in three and its "
    "attention breaks. Split attention by heads instead: give the model separate q, k and v projections (as "
    "Llama's q_proj, k_proj, v_proj, which split 'colwise' as they are) or cut each of q, k and v t ways so a "
    "rank keeps its heads' three (the toolkit GPT's own plan, shards.QKV_ROWS), with the output projection "
    "'rowwise'; or leave the attention 'replicate' and split the MLP only (its first layer 'colwise', its "
    "second 'rowwise')."
)
QKV_NAMES = ("qkv", "c_attn", "query_key_value", "wqkv", "in_proj")


def _fused_qkv(name: str, module: nn.Module) -> bool:
    """A projection to q, k and v at once: named so (GPT-2's c_attn, qkv, query_key_value), or an attention's
    layer 3 x wider out than in."""
    if isinstance(module, nn.Embedding):
        return False
    weight = module.weight
    out, inp = (weight.shape[1], weight.shape[0]) if is_conv1d(module) else (weight.shape[0], weight.shape[1])
    leaf = name.rpartition(".")[2].lower()
    return any(key in leaf for key in QKV_NAMES) or (out == 3 * inp and "att" in name.lower())


def _instead(name: str, module: nn.Module, candidates: list) -> str:
    """What to name instead of a module that cannot be split: its Linear layers, or the model's (and experts')."""
    inside = [c for c in candidates if c.startswith(name + ".")]
    if inside:
        return f"Name its Linear layers instead (e.g. {inside[:3]})"
    experts = [n for n, p in module.named_parameters(recurse=False) if p.dim() == 3]
    hint = (
        f" Its {experts} are the experts of a mixture of experts, one 3-D tensor each: split them over ranks "
        f"with expert parallelism (toolkit.moe.hf.expert_parallel(model)) rather than tensor parallelism."
        if experts
        else ""
    )
    return f"It holds no Linear layer to split.{hint} The model's splittable layers are named like {candidates[:6]}"


def apply_plan(model: nn.Module, plan, tp: TPGroup) -> nn.Module:
    """Replace the planned layers by their split forms, in place (names and tied weights kept)."""
    chosen = resolve(model, plan)
    modules = dict(model.named_modules())
    split = {
        id(p): name
        for name, style in chosen.items()
        if style != "replicate"
        for p in modules[name].parameters(recurse=False)
    }
    for name, module in modules.items():  # a tied weight is split with all its users, or not at all
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in split and chosen.get(name, "replicate") == "replicate":
                raise ValueError(
                    f"tp_plan: {name + '.' + pname!r} is the same Parameter as one of {split[id(p)]!r}'s, "
                    f"which the plan splits; plan {name!r} too (tied layers split together, e.g. "
                    f"'vocab' for an embedding and the head that reuses its weight)."
                )
    done: dict = {}
    for name, style in chosen.items():
        module = modules[name]
        if style == "replicate":
            continue
        if isinstance(module, nn.Embedding):
            new = VocabParallelEmbedding(module, tp, done, name)
        elif style == "rowwise":
            new = RowParallelLinear(module, tp, done, name)
        else:
            new = ColumnParallelLinear(module, tp, done, name, gather_output=style == "vocab", vocab=style == "vocab")
        parent, _, attr = name.rpartition(".")
        setattr(modules[parent] if parent else model, attr, new)
    return model
