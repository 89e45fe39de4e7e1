"""The wrapped model and optimizer a student holds under pp > 1: one step is `model.forward_backward(x, y)`.

    model, opt = toolkit.parallel.wrap(tiny_gpt(n_layer=4), "ddp", pp=2, microbatches=4)   # world 4: dp 2
    loss = model.forward_backward(x, y)     # the whole schedule: every micro-batch forward and backward
    opt.step(); opt.zero_grad()

A rank holds its stages (one, or virtual_stages of them), each wrapped by the data-parallel strategy over
the dp group, each with its own optimizer; `ChainedOptimizer` steps them together (Megatron-LM's
ChainedOptimizer). `model(x, y)` is an error that names forward_backward: a pipeline's forward of one
batch is no separate thing, it is interleaved with the backward in the schedule.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ... import comm
from ...moe.experts import gather_experts
from . import checkpoint
from .checkpoint import exchange

FORWARD_UNDER_PP = (
    "under pipeline parallelism (pp = {pp}) a step is a schedule of micro-batches, each stage's "
    "forward interleaved with backwards on other ranks, so there is no separate forward of the "
    "batch to call: use `loss = model.forward_backward(x, y)` (forward and backward of every "
    "micro-batch, gradients accumulated), then `opt.step()`."
)


class PipelineModel(nn.Module):
    """This rank's stages and the driver that runs them; what training tools ask of a wrapped model."""

    def __init__(self, stages: dict, driver, info: dict, tensor_parallel=None):
        super().__init__()
        self.stages = nn.ModuleDict({str(s): m for s, m in sorted(stages.items())})
        self.driver, self.pipeline = driver, info  # info: layout, schedule, actions, programs, split, ...
        self.tp_info = tensor_parallel  # the model's TensorParallel (its pieces are joined here, not by the caller)

    @property
    def scaler(self):
        return None

    def forward(self, *args, **kwargs):
        raise RuntimeError(FORWARD_UNDER_PP.format(pp=self.pipeline["pp"]))

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of the batch (x, y) in micro-batches, by the schedule; the batch's mean loss."""
        m = self.pipeline["microbatches"]
        if not torch.is_tensor(x) or not torch.is_tensor(y):
            raise TypeError(
                "forward_backward(x, y) takes the batch's inputs and targets as tensors (a pipeline's "
                "last stage needs the targets for its loss)."
            )
        if x.shape[0] % m or x.shape[0] < m:
            raise ValueError(
                f"a batch of {x.shape[0]} rows does not split into microbatches={m} equal micro-batches; "
                f"use a batch that is a multiple of {m} (e.g. {m * max(1, -(-x.shape[0] // m))}), or "
                f"another microbatches."
            )
        return self.driver.run(x.to(self.driver.device), y.to(self.driver.device))

    def full_state_dict(self) -> dict:
        """Every parameter whole, under its original name, on every rank: each stage's (over dp, then its
        experts, then its tensor-parallel pieces), then every stage's from the pipeline group."""
        state = {}
        for wrapped in self.stages.values():
            state.update(gather_experts(wrapped, wrapped.full_state_dict()))
        if self.tp_info is not None:
            state = self.tp_info.gather(state)
        return {n: t.to(self.driver.device) for n, t in exchange(state, self.driver.group).items()}

    def save_full(self, optimizer, path: str) -> None:
        """A full checkpoint of every stage, written by rank 0 (`toolkit.parallel.checkpoint.save_full` calls it)."""
        checkpoint.save_full(self, optimizer, path)

    def load_full(self, optimizer, path: str) -> None:
        """Each stage takes its part of a full checkpoint (`toolkit.parallel.checkpoint.load_full` calls it)."""
        checkpoint.load_full(self, optimizer, path)

    def memory_groups(self) -> dict:
        groups = {"params": [], "grads": [], "optimizer": []}
        for wrapped in self.stages.values():
            for key, tensors in wrapped.memory_groups().items():
                groups.setdefault(key, []).extend(tensors)
        borrowed = self.driver.tie.borrowed if self.driver.tie is not None else None
        if borrowed is not None:  # the last stage's copy of a tied weight (and the gradient it sends back)
            groups["params"].append(borrowed)
            groups["grads"] += [borrowed.grad] if borrowed.grad is not None else []
        return groups

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm of the whole model's gradient: every stage's, each piece counted once (dp slices
        where they lie, tp pieces once, replicated copies on one rank), one all-reduce over the world."""
        from ..tensor.clip import _replicated_squares, _sharded_squares

        if norm_type != 2:
            raise ValueError(
                f"norm_type={norm_type!r}: clipping under pipeline parallelism supports the L2 norm (2.0)."
            )
        info = self.tp_info
        counted = (lambda name: True) if info is None else (lambda name: info.is_split(name) or info.tp.rank == 0)
        total = torch.zeros((), dtype=torch.float32, device=self.driver.device)
        grads = []
        for wrapped in self.stages.values():
            engine = getattr(wrapped, "engine", None)
            if engine is not None and hasattr(engine, "pieces"):
                part, held = _sharded_squares(engine, counted)
            else:
                part, held = _replicated_squares(wrapped.module, counted, self.pipeline["dp_rank"] == 0)
            total, grads = total + (part if part is not None else 0), grads + held
        total = total.reshape(1).clone()
        comm.all_reduce(total)
        norm = total[0].sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return norm


class ChainedOptimizer(torch.optim.Optimizer):
    """The optimizers of this rank's stages, stepped together (param_groups: all of theirs, in stage order)."""

    def __init__(self, optimizers: list):
        self.optimizers = list(optimizers)
        groups = [g for opt in self.optimizers for g in opt.param_groups]
        super().__init__([{"params": []}], {})
        self.param_groups, self.defaults = groups, dict(self.optimizers[0].defaults)

    @property
    def state(self):
        merged: dict = {}
        for opt in self.optimizers:
            merged.update(opt.state)
        return merged

    @state.setter
    def state(self, value):  # torch.optim.Optimizer.__init__ sets it; the inner optimizers hold the real one
        pass

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("the pipeline's optimizer takes no closure: call model.forward_backward(x, y) first.")
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none)
