"""ZeRO-1/2's all-gather of the updated parameters, run beside the next forward (`overlap_param_gather=True`; Megatron-
LM's `--overlap-param-gather`).

After the step each rank holds its slice of the new parameters; the others' slices must be all-gathered before a
module uses them. Without the overlap that is one blocking all-gather a bucket right after the step. With it the
parameters stay out of date until the next forward needs them: a bucket is gathered when the first module holding its
parameters starts its forward (a forward pre-hook), and the next bucket in forward order is started then, so its
gather runs while this one's modules compute (one bucket ahead, as FSDP's prefetch). Buckets are cut in reverse
parameter order (backward's), so forward meets them in reverse.
"""

from __future__ import annotations

import functools

import torch

from .. import comm


class ParamGather:
    """Which buckets are out of date (`stale`), which gathers are in flight, and the hooks that bring them in."""

    def __init__(self, engine, module):
        self.engine = engine
        self.order = engine.pieces[::-1]  # the order forward first needs the buckets in
        self.stale: set = set()  # buckets whose parameters wait for the last step's update
        self.in_flight: dict = {}  # bucket -> (handle, this rank's slice being sent)
        for m in module.modules():
            owned = {engine.bucket_of[p] for p in m.parameters(recurse=False) if p in engine.bucket_of}
            if owned:
                m.register_forward_pre_hook(functools.partial(self._needed, sorted(owned, key=self.order.index)))
        module.register_state_dict_pre_hook(self._refuse_stale)

    def all_stale(self) -> None:
        """After the step: every bucket's parameters wait for their gather."""
        self.stale = set(self.order)

    @torch.no_grad()
    def _start(self, b) -> None:
        if b in self.stale and b not in self.in_flight:
            e = self.engine
            mine = b.mine.master.detach().to(e.dtype, copy=True)  # (16-bit) copy of my new slice
            self.in_flight[b] = (comm.all_gather(b.flat.data, mine, group=e.group, async_op=True), mine)

    def _finish(self, b) -> None:
        self._start(b)
        if b in self.in_flight:
            self.in_flight.pop(b)[0].wait()
            self.stale.discard(b)

    def _needed(self, buckets: list, module, args) -> None:
        """Forward pre-hook of a module holding parameters of `buckets`: have them, and start the next bucket's."""
        for b in buckets:
            self._finish(b)
            following = self.order.index(b) + 1
            if following < len(self.order):
                self._start(self.order[following])

    def finish_in_flight(self) -> None:
        """Before the step: a gather started ahead that no forward waited for is done before the slices change."""
        for b in list(self.in_flight):
            self._finish(b)

    def _refuse_stale(self, *_) -> None:
        """state_dict() pre-hook: between a step and the forward that gathers them the parameters are out of date
        (gathering them here would be a collective that one rank alone, saving, would wait on for ever)."""
        if self.stale:
            raise RuntimeError(
                f"state_dict(): {self.engine.name} with overlap_param_gather=True gathers the parameters the "
                f"optimizer updated only when the next forward needs them, so this rank's copy is out of date now. "
                f"For the current parameters call toolkit.parallel.full_state_dict(model) on every rank, or save "
                f"with toolkit.parallel.checkpoint.save_full(model, optimizer, path)."
            )
