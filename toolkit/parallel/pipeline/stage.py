"""One pipeline stage: the model object, keeping only its own parts, with a forward that runs them.

`cut(model, split, stage)` makes a shallow copy of the model (same class, so its `embed`, `head_loss` and
`hidden_shape` still work) that keeps the modules of one stage:

    first stage   what the model registers before its blocks (embeddings) + its run of blocks
    middle        its run of blocks
    last stage    its run of blocks + what comes after the blocks (final norm, head)

Parameter names do not change (`blocks.2.attn.qkv.weight` is still that), so `full_state_dict` and
checkpoints are keyed as for one process. Its forward is

    first:  h = embed(x);  h = block(h) for each of its blocks;  -> (h, its blocks' aux loss)
    middle: the blocks on the h it received                       -> (h, aux loss)
    last:   the blocks, then head_loss(h, y)                      -> loss (+ aux loss)

A weight shared by the first and the last stage (the GPT's token embedding, which is also its head) is
trained on the first stage only (`TiedWeight`): the last stage borrows its value once per step and sends
back the head's gradient, which the first stage adds to the embedding's in its last backward. So the
gradient is summed across the two stages, as Megatron-LM does (there with an all-reduce between two
copies, each with its own optimizer state; here one copy is trained and the other only borrowed).
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from .split import Split


class Stage(nn.Module):
    """Mixed into the model's class for one stage's copy of it; `forward` is the stage's."""

    stage: int
    first: bool
    last: bool
    container: str
    keys: tuple

    def forward(self, inputs, targets=None):
        h = self.embed(inputs) if self.first else inputs
        blocks, aux = self.get_submodule(self.container), []
        for key in self.keys:
            out = blocks[key](h)
            h, extra = out if isinstance(out, tuple) else (out, None)
            if extra is not None:
                aux.append(extra)
        extra = (self.aux_loss(aux) if hasattr(self, "aux_loss") else sum(aux)) if aux else None
        if not self.last:
            return h, extra
        loss = self.head_loss(h, targets)
        return loss if extra is None else loss + extra


def sides(model: nn.Module, container: str) -> tuple[list, list]:
    """((parent, name) of the modules registered before the blocks, those registered after), along the path
    from the model to its blocks' container: the embedding side and the head side."""
    before, after, parent = [], [], model
    for part in container.split("."):
        names = list(parent._modules)
        at = names.index(part)
        before += [(parent, n) for n in names[:at]]
        after += [(parent, n) for n in names[at + 1 :]]
        parent = parent._modules[part]
    return before, after


def _copy_path(model: nn.Module, container: str) -> nn.Module:
    """A shallow copy of the model and of every module on the way to its blocks, so a stage can drop
    children without touching the original or another stage's copy."""
    root = copy.copy(model)
    node = root
    for part in [""] + container.split(".")[:-1]:
        if part:
            child = copy.copy(node._modules[part])
            node._modules[part] = child
            node = child
        for attr in ("_modules", "_parameters", "_buffers", "_forward_hooks", "_forward_pre_hooks"):
            setattr(node, attr, type(getattr(node, attr))(getattr(node, attr)))
    return root


def cut(model: nn.Module, split: Split, stage: int, tie: TiedWeight | None = None) -> nn.Module:
    """Stage `stage` of `model` (shares the parameters of its parts with the model: nothing is copied)."""
    stages = len(split.stages)
    first, last = stage == 0, stage == stages - 1
    part = _copy_path(model, split.container)
    before, after = sides(part, split.container)
    for side, keep in ((before, first), (after, last)):
        for parent, name in side:
            if not keep:
                del parent._modules[name]
    parent_name, _, leaf = split.container.rpartition(".")
    parent = part.get_submodule(parent_name) if parent_name else part
    blocks = model.get_submodule(split.container)
    parent._modules[leaf] = nn.ModuleDict({k: blocks._modules[k] for k in split.stages[stage]})
    part.__class__ = type(f"Stage{stage}{type(model).__name__}", (Stage, type(model)), {})
    part.stage, part.first, part.last = stage, first, last
    part.container, part.keys = split.container, tuple(split.stages[stage])
    if tie is not None and first:  # the weight's own module hands back the head's gradient (it is gathered
        module, attr = tie.owner  # there under every sharding strategy, in forward and in backward)
        part.get_submodule(module).register_forward_hook(
            lambda mod, args, out: _TiedGradient.apply(out, getattr(mod, attr), tie)
        )
    if tie is not None and last:
        tie.borrow(part)
    return part


class _TiedGradient(torch.autograd.Function):
    """Identity on the output of the tied weight's module (the embedding); in backward, hands the weight the
    last stage's gradient (once, when it has come)."""

    @staticmethod
    def forward(ctx, h, weight, tie):
        ctx.tie = tie
        if tie.capture:  # the first forward of a step: the value the last stage borrows (a copy: sharding
            tie.outgoing = weight.detach().clone()  # strategies free the gathered weight after forward)
            tie.capture = False
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        incoming, ctx.tie.incoming = ctx.tie.incoming, None
        return grad, incoming, None


class TiedWeight:
    """A parameter of the first stage that the last stage uses too (a GPT's embedding and its head).

    First stage: trains it; `outgoing` is its value this step (sent after the first forward), `incoming` the
    last stage's gradient for it (received before the last backward, added there by `_TiedGradient`).
    Last stage: its users hold `borrowed`, a plain tensor (no optimizer state, not a parameter of the stage)
    that requires grad: filled with the first stage's value each step, its `.grad` is what goes back."""

    def __init__(
        self,
        name: str,
        param: nn.Parameter,
        owner: tuple[str, str],
        users: list[tuple[str, str]],
        dtype: torch.dtype,
        device,
    ):
        self.name, self.owner, self.users = name, owner, users  # (module name, attribute) on the first / last stage
        self.shape, self.dtype, self.device = tuple(param.shape), dtype, device
        self.capture, self.outgoing, self.incoming = False, None, None
        self.borrowed: torch.Tensor | None = None

    def borrow(self, stage: nn.Module) -> None:
        """On the last stage: every user of the weight points at one borrowed tensor instead."""
        self.borrowed = torch.zeros(self.shape, dtype=self.dtype, device=self.device, requires_grad=True)
        for module_name, attr in self.users:
            module = stage.get_submodule(module_name)
            del module._parameters[attr]
            setattr(module, attr, self.borrowed)


def find_tie(model: nn.Module, split: Split, dtype: torch.dtype, device) -> TiedWeight | None:
    """The weight shared by the first and the last stage, if any; any other sharing across stages is refused."""
    before, after = sides(model, split.container)
    blocks = model.get_submodule(split.container)
    owners = [
        (stage, f"{split.container}.{key}", blocks._modules[key])
        for stage, keys in enumerate(split.stages)
        for key in keys
    ]
    prefix = lambda parent: next(n for n, m in model.named_modules() if m is parent)  # noqa: E731
    owners += [(0, _join(prefix(p), n), p._modules[n]) for p, n in before]
    owners += [(len(split.stages) - 1, _join(prefix(p), n), p._modules[n]) for p, n in after]
    users: dict = {}
    for stage, name, module in owners:
        for sub, m in module.named_modules():
            for attr, p in m.named_parameters(recurse=False):
                users.setdefault(id(p), (p, []))[1].append((stage, _join(name, sub), attr))
    tie = None
    last = len(split.stages) - 1
    for p, uses in users.values():
        stages = sorted({s for s, _, _ in uses})
        if len(stages) == 1:
            continue
        if stages != [0, last]:
            names = [_join(m, a) for _, m, a in uses]
            raise ValueError(
                f"pipeline parallelism: the parameter {names[0]} is shared by stages {stages} ({names}); "
                f"only a weight shared by the first and the last stage (an embedding tied to the head) "
                f"can be split this way. Untie it, or choose pp_split so its users share a stage."
            )
        if tie is not None:
            raise ValueError(
                f"pipeline parallelism: two weights ({tie.name} and {_join(*uses[0][1:])}) are shared by "
                f"the first and the last stage; this toolkit ties one (an embedding and its head)."
            )
        owner = next((m, a) for s, m, a in uses if s == 0)
        tie = TiedWeight(_join(*owner), p, owner, [(m, a) for s, m, a in uses if s == last], dtype, device)
    return tie


def _join(a: str, b: str) -> str:
    return f"{a}.{b}" if a and b else a or b
