"""ZeRO-1 as an optimizer alone: `shard_optimizer(params, optimizer_class, **defaults)`.

`wrap(model, "zero1")` shards the optimizer states *inside* a strategy that also owns the gradients'
reduction. Courses often teach the other cut, PyTorch's `ZeroRedundancyOptimizer`: keep whatever
data parallelism synchronizes the gradients (DDP, bucketed or not), and replace only the optimizer:

    sharded = functools.partial(toolkit.parallel.shard_optimizer, optimizer_class=torch.optim.AdamW, lr=1e-3)
    model, opt = toolkit.parallel.wrap(model, "ddp", optimizer=sharded)   # DDP averages the gradients
    loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()

or, with param groups of their own options, on the DDP model's module:

    opt = toolkit.parallel.shard_optimizer([{"params": weights, "weight_decay": 0.1},
                                            {"params": biases, "weight_decay": 0.0}], torch.optim.AdamW, lr=1e-3)

How it shards, as torch's ZeroRedundancyOptimizer does: whole parameters, not slices of a flat buffer.
Each parameter gets one owner rank, chosen greedily (largest parameter first, to the rank that owns
the fewest elements so far), so every rank owns about 1/N of the elements. A rank builds
`optimizer_class` on the parameters it owns only, so it holds only their states (Adam: 8 bytes per
owned element): the ledger shows 1/N of the optimizer states. `step()`:

    1. the inner optimizer updates this rank's own parameters (their gradients are already averaged)
    2. every rank broadcasts the parameters it owns (one flat message per owner and dtype), so every
       rank ends the step with every updated parameter: exactly what the plain optimizer computes

Whole parameters, unlike the flat slices of `wrap(..., "zero1")`, make any optimizer exact whose update
looks at one tensor at a time (SGD, Adam, a LAMB-style per-tensor trust ratio, your own), at the price
of a balance that is only as even as the parameter sizes allow. An optimizer that needs every
parameter at once (L-BFGS) cannot be sharded. Communication: the broadcasts move Ψ per step, as the
all-gather of ZeRO-1 does; the gradients' all-reduce is the data parallelism's business.

`param_groups` are the full groups, with their own options (`lr`, `weight_decay`, ...), so learning-rate
schedulers work on this object; each step copies the options into the inner optimizer. `group=`
shards over a process group instead of every rank. `state_dict()` holds this rank's share of the states.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm

NEEDS_EVERY_PARAMETER = (torch.optim.LBFGS,)


class ShardedStateOptimizer(torch.optim.Optimizer):
    """What `toolkit.parallel.shard_optimizer` returns (see the module docstring)."""

    def __init__(self, params, optimizer_class, group=None, **defaults):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(
                f"shard_optimizer needs an optimizer class (e.g. torch.optim.AdamW), got "
                f"{optimizer_class!r}; pass its options as keywords: lr=1e-3, ..."
            )
        if issubclass(optimizer_class, NEEDS_EVERY_PARAMETER):
            raise ValueError(
                f"{optimizer_class.__name__} looks at every parameter at once (its line search), "
                "so it cannot be split among ranks; use an unsharded optimizer with DDP."
            )
        if not dist.is_initialized():
            raise RuntimeError(
                "shard_optimizer splits the states among ranks, so it needs torch.distributed "
                "initialized: run it inside toolkit.launch(fn, world_size)."
            )
        self.optimizer_class, self.group = optimizer_class, group
        self.ranks = comm.group_ranks(group)  # global ranks, in the group's order
        if dist.get_rank() not in self.ranks:
            raise ValueError(f"rank {dist.get_rank()} is not in the group {self.ranks} it shards over.")
        self.rank = self.ranks.index(dist.get_rank())
        self.owner: dict[int, int] = {}  # id(parameter) -> index in the group of its owner
        self.load = [0] * len(self.ranks)  # elements owned by each rank
        self.local = None
        super().__init__(params, defaults)  # calls add_param_group for each group
        self.local = optimizer_class([self._mine(g) for g in self.param_groups], **defaults)
        for full, mine in zip(self.param_groups, self.local.param_groups):  # the class's own defaults
            for key, value in mine.items():
                full.setdefault(key, value)
        self.state = self.local.state  # what this rank holds: its share

    def add_param_group(self, param_group: dict) -> None:
        """A new group (its own options); its parameters get owners, the inner optimizer its share."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        fresh = [p for p in group["params"] if id(p) not in self.owner]
        for p in sorted(fresh, key=lambda p: -p.numel()):  # stable: ties keep the model's order
            rank = min(range(len(self.load)), key=lambda r: (self.load[r], r))
            self.owner[id(p)] = rank
            self.load[rank] += p.numel()
        if self.local is not None:
            self.local.add_param_group(self._mine(group))

    def _mine(self, group: dict) -> dict:
        return {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [p for p in group["params"] if self.owner[id(p)] == self.rank],
        }

    def owned(self) -> list[torch.Tensor]:
        """The parameters whose optimizer states live on this rank."""
        return [p for g in self.local.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for full, mine in zip(self.param_groups, self.local.param_groups):  # schedulers change `full`
            mine.update({k: v for k, v in full.items() if k != "params"})
        self.local.step()
        self._broadcast_owned()
        return loss

    def _broadcast_owned(self) -> None:
        """Every owner sends its updated parameters to every rank: one flat message per owner and dtype."""
        params = [p for g in self.param_groups for p in g["params"]]
        for r, src in enumerate(self.ranks):
            kinds: dict = {}
            for p in params:
                if self.owner[id(p)] == r:
                    kinds.setdefault((p.dtype, p.device), []).append(p)
            for group in kinds.values():
                flat = torch.cat([p.detach().reshape(-1) for p in group])
                comm.broadcast(flat, src=src, group=self.group)
                if r != self.rank:
                    offset = 0
                    for p in group:
                        p.copy_(flat[offset : offset + p.numel()].view_as(p))
                        offset += p.numel()

    def load_state_dict(self, state_dict: dict) -> None:
        raise NotImplementedError(
            "shard_optimizer's state_dict() is this rank's share of the states; "
            "to resume, give each rank its own share: opt.local.load_state_dict(...)."
        )
