"""The optimizer a sharded strategy returns: the user's own optimizer, stepping only this rank's slices.

Under ZeRO (and FSDP) every rank updates only its slice of the flat buffers (`sharded.py`):

    reduced gradient slice  ->  fp32 master slice  --optimizer-->  updated master  ->  model's slice

`ShardedOptimizer` is that loop around an ordinary torch optimizer built on the rank's fp32 slices; it is a real
`torch.optim.Optimizer` (learning-rate schedulers see its `param_groups`). `check_optimizer` says which
optimizers it may wrap.

Why only some optimizers: a slice boundary may cut a weight matrix anywhere, and a padded slice holds a few fake
zeros. That is harmless exactly when the update of every element depends only on that element's own gradient and
state (SGD, Adam, AdamW, ...): each rank then computes precisely what one process would have computed for those
elements. An optimizer that looks at a whole tensor at once (LAMB's and LARS's per-layer trust ratio, Adafactor's
row and column statistics, L-BFGS's line search over all parameters, Shampoo's preconditioners) would see a
meaningless piece of a tensor. So the list below is an explicit allow-list, not a guess.
"""

from __future__ import annotations

import torch
import torch.nn as nn

# Optimizers whose update is elementwise: one element's new value depends on its own gradient and
# state, plus scalars (learning rate, step count). Adding one here is a claim about its math.
ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
)


def check_optimizer(strategy: str, optimizer_factory) -> None:
    """Raise ValueError unless `optimizer_factory` builds an optimizer from the allow-list.

    The factory is tried on a one-element dummy parameter, so nothing is communicated or allocated
    before a bad choice is reported.
    """
    try:
        probe = optimizer_factory([nn.Parameter(torch.zeros(1))])
    except Exception as exc:  # noqa: BLE001 - report any failure to build as a bad factory
        raise ValueError(
            f"strategy {strategy!r} could not build the optimizer from {optimizer_factory!r} "
            f"on a list of parameters ({type(exc).__name__}: {exc})."
        ) from exc
    if type(probe) not in ELEMENTWISE_OPTIMIZERS:
        names = ", ".join(o.__name__ for o in ELEMENTWISE_OPTIMIZERS)
        raise ValueError(
            f"strategy {strategy!r} cannot shard {type(probe).__name__}: each rank updates only its slice of "
            f"the flattened parameters, which is exact only for optimizers whose update is elementwise. "
            f"Sharded optimizers allowed: {names}. Use one of them, or an unsharded strategy ('ddp') "
            f"for {type(probe).__name__}."
        )


class ShardedOptimizer(torch.optim.Optimizer):
    """Steps this rank's slices; the strategy (`engine`) brings the results back into the model.

    step():  0. fp16: if any rank's reduced slices hold an inf or NaN, skip 1-4 (`scaler.py`)
             1-3, per sub-group of shards (`engine.step_groups()`: all at once, or ZeRO-3's): give each fp32
             master its gradient (the slice, cast to fp32 if 16-bit, unscaled), run the user's optimizer on
             those masters, drop those fp32 gradients (a transient copy, not model state)
             4. engine.after_step(): 16-bit copies of the masters; the all-gather of ZeRO-1/2
    zero_grad(): the engine clears its gradients. `param_groups` and `state` are the inner optimizer's own,
    so LR schedulers and `state_dict()` act on what is really stepped.
    """

    def __init__(self, inner: torch.optim.Optimizer, engine):
        super().__init__(inner.param_groups, inner.defaults)
        self.inner, self.engine = inner, engine
        self.param_groups, self.state = inner.param_groups, inner.state

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("sharded optimizers take no closure: call loss.backward() before step().")
        self.engine.before_step()
        scaler = self.engine.scaler
        found_inf = scaler is not None and scaler.found_inf([s.grad for s in self.engine.shards()])
        if not found_inf:  # every rank agreed (an all-reduce of the flag), so all step or all skip
            groups = [g["params"] for g in self.inner.param_groups]
            where = {id(p): i for i, members in enumerate(groups) for p in members}
            try:  # (the optimizer sees one sub-group's masters at a time: its groups are put back)
                for shards in self.engine.step_groups():
                    self._step(shards, scaler, where)
            finally:
                for group, members in zip(self.inner.param_groups, groups):
                    group["params"] = members
        if scaler is not None:
            scaler.update(found_inf)
        if not found_inf:
            self.engine.after_step()

    def _step(self, shards: list, scaler, where: dict) -> None:
        """Steps 1-3 for one sub-group of shards: its fp32 gradients exist only while it steps."""
        for s in shards:
            s.master.grad = None if s.grad is None else s.grad.to(torch.float32)  # fp32: no copy
        if scaler is not None:
            scaler.unscale_([s.master.grad for s in shards])
        if len(shards) < len(where):  # it sees only this sub-group's masters (DeepSpeed's ZeRO-3 does so):
            for i, group in enumerate(self.inner.param_groups):
                group["params"] = [s.master for s in shards if where[id(s.master)] == i]
        self.inner.step()
        for s in shards:
            s.master.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        """torch's state dict of what this rank steps (its slices' states), marked with whose slices they are."""
        return {**self.inner.state_dict(), "slices_of": self._slices_of()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Into the inner optimizer, which is what steps (torch's own would replace only this wrapper's `state`), and
        only this rank's own slices' states: another rank's have the same shapes, and would load and step wrong."""
        found, here = state_dict.get("slices_of"), self._slices_of()
        if found != here:
            raise ValueError(
                f"optimizer.load_state_dict(): this state dict holds the optimizer states of {found or 'no marked'} "
                f"slices, and this optimizer steps {here}. Each rank loads the state dict it saved itself (same "
                f"strategy and world size); to resume anywhere else, save and load a full checkpoint: "
                f"toolkit.parallel.checkpoint.save_full(model, optimizer, path) and load_full(...)."
            )
        self.inner.load_state_dict({k: v for k, v in state_dict.items() if k != "slices_of"})
        self.param_groups, self.state = self.inner.param_groups, self.inner.state

    def _slices_of(self) -> dict:
        e = self.engine
        return {"strategy": e.name, "rank": e.rank, "world": e.world, "numels": [s.master.numel() for s in e.shards()]}

    def memory_groups(self) -> dict:
        return self.engine.memory_groups()

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor the inner optimizer keeps (Adam's two moments and its step counters, ...)."""
        return [v for state in self.inner.state.values() for v in state.values() if torch.is_tensor(v)]
