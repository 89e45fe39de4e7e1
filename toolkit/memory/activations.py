"""What activations cost, measured: the bytes a forward keeps for backward, and the work of each pass.

`formulas.activation_terms` predicts, per transformer layer, what autograd saves; these two functions
measure it on a real model, so a lesson or a test can put the two side by side:

* `activations_by_module(model, modules, ...)`: one forward; the bytes saved while each module ran.
* `pass_costs(model, ...)`: one forward and its backward; the bytes kept from one to the other and the
  floating-point operations of each (torch's `FlopCounterMode`, which counts matmuls and convolutions:
  a fused attention kernel on the CPU is not in its table). Stashing against activation checkpointing
  is the difference of two such calls.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from .ledger import ActivationMeter


def activations_by_module(model: torch.nn.Module, modules, *args, **kwargs) -> tuple[list[int], int]:
    """Run `model(*args, **kwargs)` once with autograd on; return (bytes saved for backward while each of
    `modules` ran its forward, bytes saved in all). The graph is dropped afterwards.

    Each module's share is the growth of an `ActivationMeter` across its forward: what its operations
    saved (a tensor it saves that an earlier module had saved already counts there, once)."""
    meter, shares = ActivationMeter(model), []
    hooks = []
    for m in modules:
        hooks.append(m.register_forward_pre_hook(lambda mod, args: shares.append(-meter.live)))
        hooks.append(m.register_forward_hook(lambda mod, args, out: shares.append(shares.pop() + meter.live)))
    try:
        with torch.enable_grad(), meter:
            output = model(*args, **kwargs)
        total = meter.live
    finally:
        for h in hooks:
            h.remove()
    del output
    return shares, total


def pass_costs(model: torch.nn.Module, *args, **kwargs) -> dict:
    """`loss = model(*args, **kwargs); loss.backward()`, measured. Returns {"kept": bytes autograd held
    at the end of forward, "forward", "backward": FLOPs of each pass, "by_module": forward FLOPs per
    module path (e.g. "GPT.blocks.0.mlp"), "loss": the loss as a float}. Gradients are left in place."""
    meter = ActivationMeter(model)
    with FlopCounterMode(display=False) as forward, meter:
        loss = model(*args, **kwargs)
    kept = meter.live
    with FlopCounterMode(display=False) as backward:
        loss.backward()
    return {
        "kept": kept,
        "forward": forward.get_total_flops(),
        "backward": backward.get_total_flops(),
        "by_module": {name: sum(ops.values()) for name, ops in forward.get_flop_counts().items()},
        "loss": loss.item(),
    }
