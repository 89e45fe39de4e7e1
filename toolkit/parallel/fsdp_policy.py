"""Which modules become FSDP units, and which unit each parameter belongs to.

A *unit* is the grain of FSDP: the parameters of one unit are flattened into one flat parameter,
gathered together just before the unit computes and freed together right after. The choice of units
is a trade-off the FSDP paper spells out: peak parameter memory is about Σψ_i/F + max ψ_i (every
shard, plus the largest unit gathered whole), so smaller units save memory; but every unit costs two
all-gathers and a reduce-scatter per step, and small messages waste bandwidth on latency. For a
transformer the natural unit is one block: equal sizes, and the blocks run one after another.

A *wrap policy* picks the unit modules; the root (the whole model) is always a unit too and takes
every parameter not inside another unit (the embeddings, the final norm, the head). Policies:

    None (default)           any model (see `default_units`): every `toolkit.models.Block`; else the
                             model's repeated layers (the children of a ModuleList or Sequential
                             that are all of one class, e.g. nn.TransformerEncoder's layers or a
                             Hugging Face GPT-2's `transformer.h`); else the root alone
    a class, or a tuple of   every module of those classes                  wrap_policy=(Block, MoE)
    an int                   bottom-up, a module whose parameters not yet in a unit below it
                             number at least this many (torch FSDP1's size-based policy)
    a list                   exactly these modules, or their qualified names   ["blocks.0", "blocks.1"]
    a callable               fn(name, module) -> bool

Units nest: a unit inside another owns its own parameters, and the outer one gets the rest.

Shared parameters. The GPT's token embedding is also its output head: one Parameter, used by two
modules. A unit is gathered only while its module runs, so if the two users sat in different units,
one of them would compute while the tied weight is freed (or gathered twice and reduced twice). The
FSDP paper's rule: a shared parameter belongs to the unit of the *lowest common ancestor* of all its
users, whose forward encloses every use. For the GPT that is the root (the embedding and the head are
both outside the blocks), so nothing moves; a policy that makes `tok_emb` a unit of its own sees the
weight moved up to the root, and the emptied unit dropped. (torch's FSDP2 raises instead.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn


@dataclass
class UnitPlan:
    """One unit before it exists: its module, its qualified name ("" = root), its parameters in order."""

    name: str
    module: nn.Module
    params: list = field(default_factory=list)
    moved_in: list = field(default_factory=list)  # shared parameters placed here by the LCA rule


def _describe(policy) -> str:
    return getattr(policy, "__name__", None) or repr(policy)


def select(model: nn.Module, policy=None) -> list[str]:
    """Qualified names of the modules the policy makes units (the root excluded), in model order."""
    named = list(model.named_modules())
    if policy is None:
        return default_units(model)[0]
    if isinstance(policy, type):
        policy = (policy,)
    if isinstance(policy, bool):
        raise ValueError(f"wrap_policy={policy!r} is not a policy. {POLICY_HELP}")
    if isinstance(policy, int):
        if policy < 1:
            raise ValueError(f"wrap_policy={policy}: a minimum parameter count must be >= 1.")
        chosen = _by_size(model, policy)
    elif isinstance(policy, (tuple, list)) and policy and all(isinstance(c, type) for c in policy):
        chosen = [n for n, m in named if n and isinstance(m, tuple(policy))]
    elif isinstance(policy, (tuple, list)):
        names = {id(m): n for n, m in named}
        chosen = []
        for item in policy:
            if isinstance(item, nn.Module):
                if id(item) not in names:
                    raise ValueError(f"wrap_policy lists a {type(item).__name__} that is not part of this model.")
                item = names[id(item)]
            if not isinstance(item, str) or item not in dict(named):
                raise ValueError(
                    f"wrap_policy lists {item!r}, which is not a submodule of this model; "
                    f"names look like {[n for n, _ in named if n][:4]}."
                )
            chosen.append(item)
        order = [n for n, _ in named]
        chosen = sorted(set(chosen) - {""}, key=order.index)
    elif callable(policy):
        chosen = [n for n, m in named if n and policy(n, m)]
    else:
        raise ValueError(f"wrap_policy={policy!r} is not a policy. {POLICY_HELP}")
    containers = [n for n in chosen if isinstance(dict(named)[n], CONTAINERS)]
    if containers and isinstance(policy, (tuple, list)) and not all(isinstance(c, type) for c in policy):
        raise ValueError(
            f"wrap_policy lists {containers}, a module container: its forward is never called "
            f"(the model calls its children), so its unit would never be gathered. List its "
            f"children instead, e.g. {containers[0]}.0."
        )
    chosen = [n for n in chosen if n not in containers]
    if not chosen:
        classes = sorted({type(m).__name__ for n, m in named if n})
        raise ValueError(
            f"wrap_policy={_describe(policy)} matched no module of this {type(model).__name__}, so the whole "
            f"model would be one unit, gathered whole for every forward and backward; a policy that chooses "
            f"nothing is most likely a mistake. Pick the modules to shard separately: module classes in this "
            f"model are {classes}; or a minimum parameter count, or a list of names; or leave wrap_policy out "
            f"for the default. {POLICY_HELP}"
        )
    return chosen


def default_units(model: nn.Module) -> tuple[list[str], str]:
    """The units when the user names none, for any model, and why: (qualified names, a sentence).

    1. Every `toolkit.models.Block`: the FSDP paper's unit, one transformer block.
    2. Otherwise the model's *repeated layers*: wherever a ModuleList or Sequential holds at least two
       children with parameters, all of one class, each child is a unit (outermost such lists only).
       That is how transformers of any origin are built (nn.TransformerEncoder's `layers`, Hugging Face's
       `transformer.h`, a stack of Linear layers), and it gives what the paper recommends: units of
       equal size that run one after another, so the peak is the shards plus one layer.
    3. Otherwise the root alone. One unit still shards the parameters, gradients and optimizer states
       between uses (a rank keeps 1/N of them), but gathers the whole model for each forward and
       backward: name units with `wrap_policy` (a class, a size, a list) to lower that peak.
    """
    from ..models import Block

    named = list(model.named_modules())
    blocks = [n for n, m in named if n and isinstance(m, Block)]
    if blocks:
        return blocks, f"every toolkit.models.Block ({len(blocks)} units, plus the root for the rest)"
    chosen, lists = [], []
    for name, module in named:
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or any(_inside(name, c) for c in chosen):
            continue
        children = [
            (f"{name}.{n}" if name else n, c) for n, c in module.named_children() if any(True for _ in c.parameters())
        ]
        if len(children) >= 2 and len({type(c) for _, c in children}) == 1:
            chosen += [n for n, _ in children]
            lists.append(f"{name or '(root)'} ({len(children)} x {type(children[0][1]).__name__})")
    if chosen:
        return chosen, (f"the model's repeated layers, one unit each: {', '.join(lists)}, plus the root for the rest")
    return [], (
        "the root alone: this model has no repeated layers (a ModuleList or Sequential of one class) "
        "to split it by, so it is one unit, gathered whole for each forward and backward; its "
        "parameters, gradients and optimizer states are still sharded between uses. Pass wrap_policy "
        "to choose smaller units."
    )


def explain(model: nn.Module, policy=None) -> str:
    """One line for the Run: which policy chose the units, and which units it chose."""
    if policy is None:
        return f"wrap_policy=None (the default): {default_units(model)[1]}"
    units = select(model, policy)
    shown = ", ".join(units[:4]) + ", ..." * (len(units) > 4)
    return f"wrap_policy={_describe(policy)}: {len(units)} units ({shown}), plus the root"


# Modules whose forward is never called (a model iterates over them): never units. (torch FSDP1's
# size-based policy excludes them too.)
CONTAINERS = (nn.ModuleList, nn.ModuleDict)

POLICY_HELP = (
    "Valid policies: None (the default: each toolkit.models.Block, else the model's repeated layers, "
    "else the root alone), a module class or tuple of classes, an "
    "int (minimum parameters per unit), a list of modules or qualified names, or a function "
    "fn(name, module) -> bool."
)


def _by_size(model: nn.Module, min_params: int) -> list[str]:
    """Post-order: a module becomes a unit once the parameters below it not yet in a unit reach min_params."""
    chosen, seen = [], set()

    def visit(name: str, module: nn.Module) -> int:
        remaining = 0
        for child_name, child in module.named_children():
            remaining += visit(f"{name}.{child_name}" if name else child_name, child)
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                remaining += p.numel()
        if name and remaining >= min_params and not isinstance(module, CONTAINERS):
            chosen.append(name)
            return 0
        return remaining

    visit("", model)
    order = [n for n, _ in model.named_modules()]
    return sorted(chosen, key=order.index)


def _inside(name: str, unit: str) -> bool:
    return unit == "" or name == unit or name.startswith(unit + ".")


def plan(model: nn.Module, policy=None) -> list[UnitPlan]:
    """The units, root first then in model order, each with the trainable parameters it owns.

    A parameter's users are the modules that hold it directly. Each user lies in its innermost unit;
    the parameter goes to the innermost unit that contains all of them (their lowest common ancestor).
    Units left without parameters are dropped. Frozen parameters stay outside every unit.
    """
    names = [""] + select(model, policy)
    modules = dict(model.named_modules())
    units = {n: UnitPlan(n, modules[n]) for n in names}
    users: dict[int, list[str]] = {}
    first: dict[int, tuple[str, nn.Parameter]] = {}
    for module_name, module in model.named_modules():
        for attr, p in module.named_parameters(recurse=False):
            users.setdefault(id(p), []).append(module_name)
            first.setdefault(id(p), (f"{module_name}.{attr}" if module_name else attr, p))
    for key, (pname, p) in first.items():  # in model.named_parameters() order
        if not p.requires_grad:
            continue
        innermost = [max((u for u in names if _inside(m, u)), key=len) for m in users[key]]
        home = max((u for u in names if all(_inside(i, u) for i in innermost)), key=len)
        units[home].params.append(p)
        if len(set(innermost)) > 1:
            units[home].moved_in.append((pname, sorted(set(innermost))))
    return [units[n] for n in names if units[n].params]
