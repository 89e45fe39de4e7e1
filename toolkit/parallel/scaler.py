"""Dynamic loss scaling: what fp16 training needs and bf16 does not, and how the ranks agree to skip a step.

fp16 keeps 5 bits of exponent: nothing between 0 and 6e-8 (the smallest subnormal; the smallest normal
number is 6.1e-5), nothing above 65504. Gradients are often smaller than that floor: computed in fp16
they round to zero, and the step never sees them. bf16 keeps fp32's 8 exponent bits (the same range,
fewer significant bits), so its gradients do not underflow; that is why bf16 needs no scaler.

The cure for fp16 is to compute the gradients of S·loss instead of the loss: backward is linear, so
every gradient is S times larger and lands inside fp16's range. Before the step the gradients are
divided by S again, in fp32, where 1e-8 is an ordinary number. S is chosen as the step goes:

    start at S = 2^16
    each step: unscale the fp32 gradients; is any of them inf or NaN (S was too large: overflow)?
        yes -> skip the step (parameters and optimizer states unchanged), S = S / 2
        no  -> step; after `growth_interval` good steps in a row, S = 2S

(torch.amp.GradScaler's rule and defaults. DeepSpeed's fp16 optimizer is the same idea with other
defaults: a window of 1000 steps, and a "hysteresis" of 2: an overflow always skips its step, but S
halves only once the hysteresis is used up, so its first overflow skips at the same S.) A model whose
loss is itself fp16 overflows on its first step, because the loss's own gradient is S = 65536 > 65504:
the first step is skipped and training goes on at 2^15, as with torch's GradScaler. DeepSpeed would skip
that step and the next one ("Attempted loss scale: 65536, but hysteresis is 2"), and halve only then.

Across ranks. Under ZeRO and FSDP a rank holds only its slice of the averaged gradient, so an overflow
may sit in one rank's slice alone. If that rank skipped while the others stepped, the replicas would no
longer agree. So the found-inf flag is all-reduced (max) over the group before anyone decides, which is
what torch's ShardedGradScaler and DeepSpeed's overflow check do. Under DDP every rank holds the same
averaged gradient and decides the same without asking (unless it holds expert parameters of its own).

How the toolkit applies it: inside the strategy, as DeepSpeed's engine does, so the plain loop
`loss = model(x, y); loss.backward(); opt.step()` stays the plain loop. The wrapped model's outputs
pass through `scale_outputs`, the identity in forward whose backward multiplies the incoming gradient by
S (the same as scaling the loss, and the loss you see is not scaled); the optimizer's step unscales,
checks, and steps or skips. `model.scaler` is this object: its `scale`, `skipped` and `last_skipped` say
what happened, and `toolkit.train` records "loss_scale" and "skipped_step" in the Run every step.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from .. import comm
from ..runtime import env


class _ScaleGrad(torch.autograd.Function):
    """Identity in forward; multiplies the gradient by `scale` in backward."""

    @staticmethod
    def forward(ctx, t, scale):
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class LossScaler:
    """The dynamic loss scale of one wrapped fp16 model.

    scale            S, the factor the next backward's gradients carry
    growth_interval  good steps in a row before S doubles (2000); growth_factor 2, backoff_factor 0.5
    skipped          steps skipped so far; last_skipped, last_scale: the latest step's decision and its S
    group, across_ranks  the strategy sets them: whether the found-inf flag must be agreed over `group`
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        group=None,
        across_ranks: bool = False,
    ):
        self.scale, self.growth_factor, self.backoff_factor = float(init_scale), growth_factor, backoff_factor
        self.growth_interval, self.group, self.across_ranks = growth_interval, group, across_ranks
        self.good_steps, self.skipped = 0, 0
        self.last_skipped, self.last_scale = False, self.scale

    # --- 1. forward: the outputs carry S into backward ---------------------------------------------
    def scale_outputs(self, output):
        """The outputs, each floating tensor that requires grad wrapped so its gradient is multiplied by S."""

        def scale(t):
            if torch.is_tensor(t) and t.is_floating_point() and t.requires_grad:
                return _ScaleGrad.apply(t, self.scale)
            return t

        return tree_map(scale, output)

    # --- 2. the step: unscale in fp32, agree on overflow, step or skip ---------------------------------
    @torch.no_grad()
    def unscale_and_check(self, grads) -> bool:
        """Divide the fp32 gradients by S in place; return True when any rank found an inf or NaN.
        Call it once per step, before the optimizer: the caller skips the step on True, then `update`."""
        self.unscale_(grads)
        return self.found_inf(grads)

    @torch.no_grad()
    def unscale_(self, grads) -> None:
        """Divide the fp32 gradients by S in place."""
        for g in grads:
            if g is not None:
                g.mul_(1.0 / self.scale)

    @torch.no_grad()
    def found_inf(self, grads) -> bool:
        """True when any rank's gradients hold an inf or NaN (a vote over `group` when across_ranks).

        Scaled or unscaled alike: an fp16 gradient is finite exactly when it is finite divided by S in fp32
        (65504 / S overflows fp32 only for S below 1e-34), so a sharded optimizer may vote on its 16-bit
        slices before it makes any fp32 copy, as DeepSpeed's overflow check does."""
        grads = [g for g in grads if g is not None]
        device = grads[0].device if grads else env.device()  # a rank may hold no gradient: it still votes
        found = torch.zeros(1, device=device)
        for g in grads:
            found += g.isfinite().logical_not().any()  # tensor arithmetic: no host sync per gradient
        if self.across_ranks:
            comm.all_reduce(found, op="max", group=self.group)
        return False if found.is_meta else bool(found.item())  # meta tensors (a simulation): no values

    def update(self, found_inf: bool) -> None:
        """After the step: halve S on an overflow, double it after growth_interval good steps."""
        self.last_skipped, self.last_scale = found_inf, self.scale
        if found_inf:
            self.skipped += 1
            self.good_steps = 0
            self.scale *= self.backoff_factor
        else:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0

    def clip_norm(self, clip, max_norm: float) -> torch.Tensor:
        """Clip gradients that still carry S: `clip(max_norm · S)` is clipping the true gradients to
        `max_norm`; the norm it returns, divided by S, is the true norm (inf after an overflow)."""
        return clip(max_norm * self.scale) / self.scale

    def __repr__(self) -> str:
        return f"LossScaler(scale={self.scale:g}, skipped={self.skipped}, good_steps={self.good_steps})"


def scaler_for(dtype) -> LossScaler | None:
    """A LossScaler when the model computes in fp16; None for fp32 and bf16 (no underflow to fight)."""
    return LossScaler() if dtype == torch.float16 else None
