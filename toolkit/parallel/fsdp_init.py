"""Deferred initialization: build a model too big for one rank without ever holding all of it.

    with torch.device("meta"):
        model = tiny_gpt(n_layer=48)              # shapes only: no memory, no values
    model, opt = wrap(model, "fsdp", param_init_fn=seeded_init(seed=0))

On the meta device a module has shapes and dtypes but no storage. FSDP then creates the units one at
a time (the FSDP paper's recipe): materialize the unit's parameters, initialize them, keep this rank's
shard, free the rest, move to the next unit. A rank's peak during construction is its shards so far
plus one whole unit, never the whole model.

Why a seeded function. A normal construction draws every weight from one random stream in
construction order; a unit built alone cannot reproduce its place in that stream. So the values must
depend on something a unit knows by itself: its modules' names. `seeded_init(seed)` returns
`init(name, module)`, which seeds a generator from (seed, name) and initializes that module's own
parameters. Applied to a normally built model (`initialize(model, init)`) it gives exactly the values
the deferred construction gives, on any number of ranks, which is how the tests check it.

`param_init_fn(name, module)` may be any function of that shape: it must fill every parameter the
module holds directly (`module.parameters(recurse=False)`), in place, and depend only on its arguments.
A tied weight is initialized by each of its users in model order, the last one winning, as
`initialize` does too.
"""
from __future__ import annotations

import hashlib

import torch
import torch.nn as nn


def _derived_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:7], "little")


def seeded_init(seed: int = 0, std: float = 0.02):
    """`init(name, module)`: the GPT's recipe (Linear and Embedding weights ~ N(0, std), biases 0),
    any other module's own `reset_parameters()`, all drawn from a generator seeded by (seed, name)."""

    @torch.no_grad()
    def init(name: str, module: nn.Module) -> None:
        own = list(module.parameters(recurse=False))
        if not own:
            return
        generator = torch.Generator(device=own[0].device)
        generator.manual_seed(_derived_seed(seed, name))
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, std, generator=generator)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif hasattr(module, "reset_parameters"):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(_derived_seed(seed, name))
                module.reset_parameters()
        else:
            raise ValueError(f"seeded_init does not know how to initialize {type(module).__name__} "
                             f"({name!r}): give it a reset_parameters() method, or pass your own "
                             f"param_init_fn(name, module).")

    init.__name__ = f"seeded_init(seed={seed})"
    return init


@torch.no_grad()
def initialize(model: nn.Module, init) -> nn.Module:
    """Apply `init(name, module)` to every module that holds parameters directly: the reference values."""
    for name, module in model.named_modules():
        if next(module.parameters(recurse=False), None) is not None:
            init(name, module)
    return model


def is_deferred(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def check_deferred(model: nn.Module, param_init_fn) -> None:
    """A model on the meta device needs an init function, and only its trainable parameters may be meta."""
    if param_init_fn is None:
        raise ValueError("the model has parameters on the meta device (no values yet): pass "
                         "param_init_fn=toolkit.parallel.fsdp.seeded_init(seed) (or your own fn(name, module)) "
                         "so that FSDP can initialize each unit as it materializes it.")
    if not callable(param_init_fn):
        raise ValueError(f"param_init_fn must be a function fn(name, module), got {param_init_fn!r}.")
    frozen = [n for n, p in model.named_parameters() if p.is_meta and not p.requires_grad]
    buffers = [n for n, b in model.named_buffers() if b.is_meta]
    if frozen or buffers:
        raise ValueError(f"deferred initialization handles trainable parameters only; these are on the meta "
                         f"device too: {(frozen + buffers)[:4]}. Build them on a real device.")


def owners(model: nn.Module) -> dict:
    """id(parameter) -> [(position in model order, qualified module name, module, attribute)]."""
    found: dict = {}
    for index, (name, module) in enumerate(model.named_modules()):
        for attr, p in module._parameters.items():
            if p is not None:
                found.setdefault(id(p), []).append((index, name, module, attr))
    return found


@torch.no_grad()
def materialize(params: list, fp32_views: list, holders: dict, param_init_fn, unit_name: str) -> list:
    """Replace the meta `params` by Parameters viewing `fp32_views` in every module holding them, then
    run `param_init_fn` on each of those modules, in model order. Returns the new Parameters."""
    mine = {id(p) for p in params}
    users = {}
    for p in params:
        for index, module_name, module, _ in holders[id(p)]:
            users[index] = (module_name, module)
    for module_name, module in users.values():  # check first: nothing is replaced if this raises
        others = [n for n, q in module.named_parameters(recurse=False) if id(q) not in mine]
        if others:
            raise ValueError(f"deferred initialization: module {module_name!r} holds parameters of two units "
                             f"({unit_name or '(root)'!r} and another, for {others}); put all of its "
                             f"parameters in one unit with the wrap policy.")
    new = []
    for p, view in zip(params, fp32_views):
        real = nn.Parameter(torch.empty(0, dtype=view.dtype, device=view.device), requires_grad=p.requires_grad)
        real.data = view  # not nn.Parameter(view): that would share the flat buffer's version counter, and
        #                   every all-gather into the buffer would look like an in-place edit to autograd
        for _, _, module, attr in holders[id(p)]:
            module._parameters[attr] = real
        new.append(real)
    for index in sorted(users):
        param_init_fn(*users[index])
    return new
