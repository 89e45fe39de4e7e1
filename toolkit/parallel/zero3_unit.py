"""One ZeRO-3 unit: the parameters one module owns directly, flattened, of which a rank keeps only its slice.

`zero3.py` decides when a unit is gathered and freed (the module's forward and backward hooks); this file is what a
unit holds: its flat buffer, the slice kept all the time, the shard the optimizer steps, and where the module's
parameters point (`flat.ParamViews`).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .flat import FlatBuffer, ParamViews
from .sharded import Shard, ShardedEngine


class Unit:
    """The parameters one module owns directly, flattened; between uses only this rank's slice is kept.

    flat:   the gathered buffer, in the compute dtype. It has memory only while a user of the unit computes;
            the module's parameters are views of it then, and this rank's pieces of `kept` between uses
            (`views`, a `flat.ParamViews`).
    kept:   this rank's slice of the parameters, the one copy kept all the time (in fp32 training it
            is also the master the optimizer steps; with mixed precision, a 16-bit copy of it).
    mine:   the Shard the optimizer sees (fp32 master, averaged gradient slice).
    users:  every module that uses one of these parameters directly (a tied weight has two).
    """

    def __init__(self, engine: ShardedEngine, name: str, params: list):
        self.name, self.params, self.index = name, params, {p: i for i, p in enumerate(params)}
        self.flat, master = engine.flatten(params)
        if engine.dtype == torch.float32:
            master = nn.Parameter(master.detach().clone())  # its own memory: the flat buffer is freed below
            self.kept = master
        else:
            self.kept = self.flat.shard(engine.rank).clone()
        self.views = ParamViews(params, self.flat, self.kept, engine.rank)
        self.views.sharded()  # the module's parameters: this rank's pieces of them, until a forward gathers
        self.flat.free()  # from now on this rank keeps only its slice
        self.mine = Shard(master)
        self.users: list[nn.Module] = []
        self.done_forward: set[int] = set()  # users whose forward has finished in this pass
        self.grads: FlatBuffer | None = None  # full gradients, while they arrive during backward
        self.waiting = len(params)  # gradients not yet arrived in this backward

    def __repr__(self) -> str:
        return f"Unit({self.name!r}, {len(self.params)} parameters, {self.flat})"
