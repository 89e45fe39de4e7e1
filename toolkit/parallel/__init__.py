"""One strategy per file; `wrap` turns (model, optimizer) into their data-parallel form.

    model, opt = toolkit.parallel.wrap(model, "zero2", optimizer=partial(torch.optim.AdamW, lr=1e-3))
    loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()

Each strategy module provides `wrap(model, optimizer, **options) -> (model, optimizer)` and its
wrapped model provides `full_state_dict()`. The registry below is the whole list.
"""

from __future__ import annotations

import importlib

import torch

# strategy name -> (module, function): imported on first use so each file stands alone.
STRATEGIES = {
    "local": ("toolkit.parallel.local", "wrap"),
    "dp": ("toolkit.parallel.ddp", "wrap_naive"),
    "ddp": ("toolkit.parallel.ddp", "wrap"),
    "zero1": ("toolkit.parallel.zero", "wrap_zero1"),
    "zero2": ("toolkit.parallel.zero", "wrap_zero2"),
    "zero3": ("toolkit.parallel.zero", "wrap_zero3"),
    "fsdp": ("toolkit.parallel.fsdp_wrap", "wrap"),
}


def wrap(model: torch.nn.Module, strategy: str, *, optimizer=torch.optim.AdamW, **options):
    """Wrap `model` for `strategy`; `optimizer` is any callable taking parameters and returning an optimizer.

    Model-parallel options (tp=, sequence_parallel=, tp_comm_overlap=, tp_plan=, pp=, microbatches=, schedule=,
    virtual_stages=, pp_split=, cp=, cp_attention=, order=) lay the world out as dp x pp x cp x tp (`compose.py`,
    `model.mesh`, ranks in Megatron's order unless `order=` says otherwise); `strategy` is then the data-parallel
    method over the dp x cp group ("local": dp = 1, cp = 1)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {sorted(STRATEGIES)}.")
    if not callable(optimizer):
        raise TypeError(
            "optimizer must be a callable that takes parameters and returns a torch optimizer, "
            "e.g. torch.optim.AdamW or functools.partial(torch.optim.AdamW, lr=1e-3)."
        )
    module, function = STRATEGIES[strategy]
    try:
        build = getattr(importlib.import_module(module), function)
    except ModuleNotFoundError as exc:
        raise NotImplementedError(f"strategy {strategy!r} is not implemented yet ({module} is missing).") from exc
    from . import checkpointing, compose

    by_operation = options.get("activation_checkpointing") == checkpointing.BY_OPERATION
    if by_operation and (options.get("tp", 1) > 1 or options.get("cp", 1) > 1):
        raise ValueError(
            'activation_checkpointing="op" is not built for tensor or context parallelism: its policy would recompute '
            "their collectives in backward. Use activation_checkpointing=True (or a whole number k) with tp= or cp=."
        )
    if options.get("activation_checkpointing") == checkpointing.ATTENTION and options.get("cp", 1) > 1:
        raise ValueError(
            'activation_checkpointing="attention" is not built for context parallelism: cp replaces the core attention '
            "with its ring, which keeps its own blocks' results and would pass K and V around again to recompute. "
            "Use activation_checkpointing=True (or a whole number k) with cp=."
        )
    options = checkpointing.apply_option(model, strategy, options)  # every strategy, not only fsdp
    if compose.wants(options):  # tp= / pp= / cp= ...: a dp x pp x cp x tp layout, `strategy` over dp x cp
        return compose.wrap(model, strategy, build, optimizer, options)
    return build(model, optimizer, **options)


def shard_optimizer(params, optimizer_class, *, group=None, **defaults):
    """`optimizer_class(params, **defaults)` with its states split among the ranks of `group` (default:
    every rank), shaped like torch's ZeroRedundancyOptimizer: ZeRO-1 as an optimizer alone, beside any
    data parallelism that averages the gradients. See `optimizer_sharding.py`."""
    from .optimizer_sharding import ShardedStateOptimizer

    return ShardedStateOptimizer(params, optimizer_class, group=group, **defaults)


def full_state_dict(model: torch.nn.Module) -> dict:
    """The full, unsharded parameters under their original names, on every rank, whatever the strategy.

    Experts split over ranks (toolkit.moe) appear under their global names (`...experts.{i}.w1`),
    gathered from their owners, so an expert-parallel run compares directly with a one-rank run.
    Tensor-parallel pieces (`tp=`) are all-gathered over the tp group and joined (`tensor/state.py`).
    """
    from ..moe.experts import gather_experts

    if hasattr(model, "full_state_dict"):
        state = model.full_state_dict()
    else:
        state = {name: p.detach().clone() for name, p in model.named_parameters()}
    if getattr(model, "tensor_parallel", None) is not None:
        state = model.tensor_parallel.gather(state)
    return gather_experts(model, state)


def parameter_shapes(model: torch.nn.Module) -> dict:
    """{name: shape} of every parameter as this rank's model computes with it, whatever the strategy (under tp=,
    this rank's tensor-parallel pieces). Between uses ZeRO-3's and FSDP's parameters are only this rank's pieces of
    them (`flat.ParamViews`), so their shapes come from the strategy's layout, not from `p.shape`."""
    engine = getattr(model, "engine", None)
    if engine is not None and hasattr(engine, "shapes"):
        return engine.shapes()
    return {n: p.shape for n, p in getattr(model, "module", model).named_parameters()}


def check_options(strategy: str, options: dict, valid) -> None:
    """Strategies call this first: an unknown option is a ValueError that lists the valid ones."""
    unknown = set(options) - set(valid)
    if unknown:
        raise ValueError(
            f"strategy {strategy!r} got unknown option(s) {sorted(unknown)}; valid options: {sorted(valid)}."
        )
