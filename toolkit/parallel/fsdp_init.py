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
module holds directly (`module.parameters(recurse=False)`), and every buffer it holds that was built on
meta, in place, and depend only on its arguments. A tied weight is initialized by each of its users in
model order, the last one winning, as `initialize` does too.

Buffers. A model built on meta has its buffers there too (Llama's rotary `inv_freq`, BERT's `position_ids`):
values computed from the configuration, not drawn, that only the model knows how to compute. They are made
on the device when the model is wrapped and given their values by `param_init_fn` on the module holding
them: `own_init(model)` is the model's own per-module init (Hugging Face's `model._init_weights(module)`,
which computes those buffers; torch modules' `reset_parameters()`), as torchtitan's `init_weights` and
torch's meta-init recipe (`to_empty`, then each module's reset) do.
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
            if next(module.buffers(recurse=False), None) is not None:
                raise ValueError(
                    f"seeded_init draws parameters (the GPT's recipe); {name!r} ({type(module).__name__}) "
                    f"holds buffers built on meta whose values only the model knows how to compute. "
                    f"Pass param_init_fn=toolkit.parallel.fsdp_init.own_init(model) (the model's own "
                    f"init, e.g. Hugging Face's), or your own fn(name, module)."
                )
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
            raise ValueError(
                f"seeded_init does not know how to initialize {type(module).__name__} "
                f"({name!r}): give it a reset_parameters() method, or pass your own "
                f"param_init_fn(name, module)."
            )

    init.__name__ = f"seeded_init(seed={seed})"
    return init


def own_init(model: nn.Module, seed: int = 0):
    """`init(name, module)`: the model's own init of one module, parameters and buffers, drawn from torch's RNG
    seeded by (seed, name): Hugging Face's `model._init_weights(module)` when the model has one, else the
    module's `reset_parameters()`. (A parent's init that rewrites its children's weights, as GPT-2's attention
    scales its projection's, is not replayed: each module is initialized by its own rule.)"""
    model_init = getattr(model, "_init_weights", None)

    @torch.no_grad()
    def init(name: str, module: nn.Module) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_derived_seed(seed, name))
            if model_init is not None:
                model_init(module)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()
            elif list(module.parameters(recurse=False)) or list(module.buffers(recurse=False)):
                raise ValueError(
                    f"own_init: {type(model).__name__} has no per-module init (_init_weights) and "
                    f"{name!r} ({type(module).__name__}) no reset_parameters(); pass your own "
                    f"param_init_fn(name, module)."
                )

    init.__name__ = f"own_init({type(model).__name__}, seed={seed})"
    return init


@torch.no_grad()
def materialize_buffers(model: nn.Module, device, param_init_fn) -> None:
    """Every buffer onto `device`; one built on meta is made there empty and given its value by
    `param_init_fn(name, module)` (a module that also holds meta parameters gets it with them, in its unit)."""
    for name, module in model.named_modules():
        built_on_meta = any(b is not None and b.is_meta for b in module._buffers.values())
        module._buffers.update(
            {
                k: torch.empty_like(b, device=device) if b.is_meta else b.to(device)
                for k, b in module._buffers.items()
                if b is not None
            }
        )
        if built_on_meta and not any(p.is_meta for p in module.parameters(recurse=False)):
            param_init_fn(name, module)


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
    """A model on the meta device needs an init function, and only its trainable parameters and its buffers may
    be meta (buffers are made when wrapped: `materialize_buffers`)."""
    if param_init_fn is None:
        raise ValueError(
            "the model has parameters on the meta device (no values yet): pass "
            "param_init_fn=toolkit.parallel.fsdp.seeded_init(seed) (or your own fn(name, module)) "
            "so that FSDP can initialize each unit as it materializes it."
        )
    if not callable(param_init_fn):
        raise ValueError(f"param_init_fn must be a function fn(name, module), got {param_init_fn!r}.")
    frozen = [n for n, p in model.named_parameters() if p.is_meta and not p.requires_grad]
    if frozen:
        raise ValueError(
            f"deferred initialization handles trainable parameters and buffers; these frozen "
            f"parameters are on the meta device too: {frozen[:4]}. Build them on a real device, or "
            f"make them trainable while the model is wrapped."
        )


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
            raise ValueError(
                f"deferred initialization: module {module_name!r} holds parameters of two units "
                f"({unit_name or '(root)'!r} and another, for {others}); put all of its "
                f"parameters in one unit with the wrap policy."
            )
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
