"""AdamW as one fused kernel, the way the papers' runs stepped: for simulating what they paid.

torch's default AdamW (`foreach`) updates the parameters in nine passes over memory (the moments, the
bias corrections, the square root, the division, the weight decay), each reading and writing whole
tensors: about 100 bytes per parameter. Megatron-LM stepped with apex's `FusedAdam`, one multi-tensor
kernel that reads the parameter, its gradient and both moments and writes three of them back (28 bytes
per fp32 parameter); torch has the same kernel (`torch._fused_adamw_`, behind `AdamW(fused=True)`), but
its `fused=True` refuses meta tensors, so a simulation could not ask for it. This optimizer calls that
kernel directly: the same update (`tests/test_sim_papers.py` holds it to torch's AdamW on real tensors),
recorded by the simulator as one operation with its bytes.

    simulate(model_fn, "ddp", 64, optimizer=FusedAdamW, ...)
"""

from __future__ import annotations

import torch


class FusedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay), every parameter of a group in one `torch._fused_adamw_` call."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2):
        if not 0.0 <= lr or not 0.0 <= eps or not 0.0 <= weight_decay or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(
                f"FusedAdamW: lr={lr}, eps={eps}, weight_decay={weight_decay} must be >= 0 and betas "
                f"{betas} in [0, 1), as torch.optim.AdamW requires."
            )
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
            states = [self.state[p] for p in params]
            steps = [s["step"] for s in states]
            torch._foreach_add_(steps, 1)
            beta1, beta2 = group["betas"]
            torch._fused_adamw_(
                params,
                [p.grad for p in params],
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
                [],
                steps,
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                amsgrad=False,
                maximize=False,
            )
        return loss
