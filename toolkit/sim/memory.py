"""Memory over a step, by category, from the tensors that exist: torch's `MemTracker`, taught our categories.

`torch.distributed._tools.mem_tracker.MemTracker` is a dispatch mode that sees every tensor an
operation creates, follows each storage until it is freed (or resized, as sharded strategies free a
gathered unit), and keeps a running total per reference type and its peak. It works the same on meta
tensors (a simulated rank) and on real ones, which is how the simulator is checked against real runs.

Its seven reference types, as this toolkit names them (two are used for what our strategies have and
plain PyTorch does not):

    Parameter -> params       the parameters a rank keeps between steps (its shards, or everything)
    Buffer    -> gathered     flat buffers that hold a unit's full parameters only while it computes
    Gradient  -> grads        gradients the strategy keeps (its memory_groups, as the ledger counts)
    Optstate  -> optimizer    fp32 masters, Adam's moments, step counters
    Other     -> comm         buffers made during the step and handed to a collective
    Activation-> activations  made in forward and still alive (what autograd saved for backward)
    Temp      -> temporary    made in backward or the step and not yet one of the above

The strategy says what its tensors are (`memory_groups`, the ledger's source): `classify` tags them
before every step; what the step creates is tagged by when it appears, and a tensor handed to the
collectives door is tagged comm.
"""

from __future__ import annotations

from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType

from ..memory.ledger import memory_groups
from ..trace.events import current_phase

NAMES = {
    _MemRefType.PARAM: "params",
    _MemRefType.BUFFER: "gathered",
    _MemRefType.GRAD: "grads",
    _MemRefType.OPT: "optimizer",
    _MemRefType.OTH: "comm",
    _MemRefType.ACT: "activations",
    _MemRefType.TEMP: "temporary",
}
CATEGORIES = tuple(NAMES.values())
_FRESH = (_MemRefType.ACT, _MemRefType.TEMP)  # made during the step, not claimed by anything yet


def short_name(name: str) -> str:
    """'FSDPModel.module.blocks.1.mlp' -> 'blocks.1.mlp': the module tracker's name without the wrapper."""
    parts = name.split(".")[1:]
    if parts[:1] == ["module"]:
        parts = parts[1:]
    return ".".join(parts) or "(model)"


def _storage_key(t):
    return t.untyped_storage()._cdata


class StepMemory(MemTracker):
    """A MemTracker that names our categories and notes when (phase, module) the peak happened."""

    def __init__(self):
        super().__init__()
        self._gathered: set | None = None  # storages that hold nothing between uses (found once)
        self.peak_total = 0
        self.peak_categories: dict = dict.fromkeys(CATEGORIES, 0)
        self.peak_moment: dict = {}
        self.moments: dict = {}  # (pass, phase, module, action) -> bytes per category at that moment's highest
        self._moment_totals: dict = {}
        self._last_entered: dict = {}  # module name -> when it last began (a count of beginnings)
        self._entries = 0
        self._actions = 0  # the model's own forwards and backwards begun: a pipeline's micro-batch and pass
        self._root = None  # the first module to begin a forward: the model (or a pipeline stage's first part)

    # --- telling the tracker what the strategy's tensors are ---------------------------------------
    def classify(self, model, optimizer=None) -> None:
        """Tag the strategy's tensors: optimizer, grads, params (a storage in several: the ledger's first),
        and as gathered the parameter buffers that are empty between steps (ZeRO-3's and FSDP's units)."""
        groups = memory_groups(model, optimizer)
        params = [t for t in groups["params"] if t is not None]
        if self._gathered is None:
            self._gathered = {_storage_key(t) for t in params if t.untyped_storage().nbytes() == 0}
        for category, reftype in (("optimizer", _MemRefType.OPT), ("grads", _MemRefType.GRAD)):
            for t in groups[category]:
                if t is not None:
                    self._update_and_maybe_create_winfos(t, reftype)
        for t in params:
            gathered = _storage_key(t) in self._gathered
            self._update_and_maybe_create_winfos(t, _MemRefType.BUFFER if gathered else _MemRefType.PARAM)
        for b in model.buffers():
            self._update_and_maybe_create_winfos(b, _MemRefType.PARAM)

    def communicated(self, tensor) -> None:
        """A tensor handed to a collective: comm, unless it is already one of the strategy's own."""
        for st in [tensor.untyped_storage()]:
            winfo, _ = self._WINFO.get(st, (None, None))
            if winfo is None or winfo.reftype in _FRESH:
                self._update_and_maybe_create_winfos(tensor, _MemRefType.OTH)

    # --- MemTracker's hooks, adjusted ----------------------------------------------------------------
    def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
        """Keep the tags `classify` gave (MemTracker would call a gathered unit's views parameters);
        tag a gradient as grads when autograd hands it over."""
        for p in module.parameters():
            if install_grad_hooks and p not in self._param_to_grad_hook_handles and p.requires_grad:
                self._param_to_grad_hook_handles[p] = (
                    p.register_hook(self._grad),
                    p.register_post_accumulate_grad_hook(self._accumulated),
                )
        return 0, 0

    def _pre_fw_hook(self, module, inputs) -> None:
        """A pipeline stage's forward runs once per micro-batch: MemTracker takes a root module's second forward
        in one iteration for the next iteration and refuses it; only the rank's peak is kept here, so allow it."""
        self._entered(module)
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            if set(self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)} == {"Global"}:
                return
        super()._pre_fw_hook(module, inputs)

    def _pre_bw_hook(self, module, args) -> None:
        self._entered(module)
        super()._pre_bw_hook(module, args)

    def _entered(self, module) -> None:
        """When each module last began its forward or backward: the module running now is the latest that has not
        ended (in backward a module whose inputs need no gradient is never told it has ended: `module`). And how
        many forwards and backwards the model has begun, counted where the first module to begin a forward (the
        model, a pipeline stage's first part) begins again: the same count at every depth, a moment's key."""
        if module is not None:
            self._entries += 1
            self._last_entered[self._mod_tracker.get_known_fqn(module)] = self._entries
            if self._root is None and not self._mod_tracker.is_bw:
                self._root = module
            self._actions += module is self._root

    def _grad(self, grad) -> None:
        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

    def _accumulated(self, param) -> None:
        if param.grad is not None:  # (a sharded strategy may already have taken it into its buffer)
            self._update_and_maybe_create_winfos(param.grad, _MemRefType.GRAD)

    def _update_peak_stats(self, peak_state) -> None:
        """The rank's peak, and the highest total at each moment of the step: a pass, phase and module, and which of
        the model's forwards and backwards it is in (under pipeline parallelism, which micro-batch's). MemTracker
        keeps a peak per module object; these are by name, which is what a deeper model's moments are matched by
        (`toolkit.sim.sweep`)."""
        total = sum(snap[_TOTAL_KEY] for snap in self._curr_mem_snap.values())
        phase = current_phase()
        moment = ("backward" if self._mod_tracker.is_bw else phase, phase, self.module(), self._actions)
        if total > self._moment_totals.get(moment, -1):
            self._moment_totals[moment] = total
            self.moments[moment] = self.current()
        if total > self.peak_total:
            self.peak_total = total
            self.peak_categories = self.moments[moment]
            self.peak_moment = {"phase": phase, "module": moment[2], "pass": moment[0]}

    # --- reading it ------------------------------------------------------------------------------------
    def current(self) -> dict:
        """Bytes alive now per category (all devices together)."""
        out = dict.fromkeys(CATEGORIES, 0)
        for snap in self._curr_mem_snap.values():
            for reftype, name in NAMES.items():
                out[name] += snap.get(reftype, 0)
        return out

    def total(self) -> int:
        return sum(snap[_TOTAL_KEY] for snap in self._curr_mem_snap.values())

    def module(self) -> str:
        """The module running now, by its name in the user's model ("" between modules): of those begun and not
        ended, the latest begun (in forward the innermost; in backward the tracker keeps some that ended, e.g. a
        dropout whose backward's end it never sees, and the deepest name would stay stuck on one of them)."""
        names = [n for n in self._mod_tracker.parents if n != "Global"]
        return short_name(max(names, key=lambda n: self._last_entered.get(n, 0))) if names else ""

    def reset_peak(self) -> None:
        self.peak_total = 0
        self.moments, self._moment_totals = {}, {}
        self._update_peak_stats(None)
