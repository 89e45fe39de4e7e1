"""What is in memory on this rank right now, counted from the real tensors.

`formulas.py` says what ZeRO or FSDP *should* cost; this file measures what they *do* cost, so a lesson
can put the two side by side. Three tools (and `activations.py` for one forward's activations):

* `ledger(model, optimizer)`: bytes of parameters, gradients and optimizer states that exist now.
* `ActivationMeter`: bytes autograd keeps for the backward pass (activations), live and peak.
* `record_memory(...)`: one sample of both into the trace, labelled with the current phase, so a
  Run shows memory over time per category.

Counting rule: a tensor costs the bytes of its *storage* (`untyped_storage().nbytes()`), and a storage
is counted once however many tensors view it, across categories too (a tied weight, a parameter that is
a view into a flat buffer, a gradient bucket). A storage resized to 0 (how FSDP frees unsharded
parameters while autograd still references them) costs 0. Each category and the total are in bytes.
"""

from __future__ import annotations

import threading
import weakref

import torch

from ..trace import events as _events

CATEGORIES = ("params", "grads", "optimizer")


def _key(t: torch.Tensor, meta: bool = False):
    """Identity of the memory behind `t`: (device, address). None when nothing is allocated.

    A meta tensor has sizes but no memory; with `meta` it counts as what it would allocate (a
    simulated rank's tensors are all meta: toolkit.sim), identified by its storage object.
    """
    if t.is_sparse or (t.is_meta and not meta):
        return None
    storage = t.untyped_storage()
    if t.is_meta:
        return (t.device, storage._cdata) if storage.nbytes() else None
    if storage.data_ptr() == 0 or storage.nbytes() == 0:
        return None
    return (t.device, storage.data_ptr())


def _tensors(value):
    """Every tensor inside an optimizer state value (tensors, or lists/tuples/dicts of them)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def memory_groups(model: torch.nn.Module, optimizer=None) -> dict:
    """The tensors per category: the wrapped model's own account when it has one, else the plain reading.

    A strategy knows where its bytes live (flat shards, gradient buckets, fp32 masters), so it reports
    them through `memory_groups()`. A plain model's are its parameters, their `.grad`, and every
    tensor in `optimizer.state`.
    """
    if hasattr(model, "memory_groups"):
        return model.memory_groups()
    params = list(model.parameters())
    state = []
    if optimizer is not None and hasattr(optimizer, "state"):
        for per_param in optimizer.state.values():
            state.extend(_tensors(per_param))
    return {"params": params, "grads": [p.grad for p in params if p.grad is not None], "optimizer": state}


def ledger(model: torch.nn.Module, optimizer=None, *, meta: bool = False) -> dict:
    """Measured bytes on this rank: {"params", "grads", "optimizer", (other categories), "total"}.

    Categories are counted in that order and a storage counts in the first one that holds it.
    Optimizer states include every tensor the optimizer keeps: for Adam that is exp_avg and exp_avg_sq
    (2 x 4 bytes per fp32 parameter) plus one 4-byte `step` scalar per parameter tensor.
    On CUDA, `cuda_allocated` (torch.cuda.memory_allocated) is added as a cross-check: it also holds
    activations, buffers, workspace and the allocator's rounding, so it is at least `total`.
    `meta=True` counts meta tensors as the bytes they would take (a simulated rank, toolkit.sim).
    """
    groups = memory_groups(model, optimizer)
    missing = [c for c in CATEGORIES if c not in groups]
    if missing:
        raise ValueError(
            f"memory_groups() of {type(model).__name__} lacks {missing}; it must return "
            f"{{'params': [...], 'grads': [...], 'optimizer': [...]}} (lists of tensors)."
        )
    seen = set()
    result = {}
    for category in list(CATEGORIES) + [c for c in groups if c not in CATEGORIES]:
        total = 0
        for t in groups[category]:
            if t is None:
                continue
            key = _key(t, meta)
            if key is not None and key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
        result[category] = total
    result["total"] = sum(result.values())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        result["cuda_allocated"] = torch.cuda.memory_allocated()
    return result


class _Saved:
    """What autograd keeps instead of a saved tensor: the tensor itself, in a box we can watch die."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class ActivationMeter:
    """Bytes of the tensors autograd saves for backward: `live` now, `peak` since the last reset.

        meter = ActivationMeter(model)
        with meter:                 # tensors saved inside are counted...
            loss = model(x, y)
        meter.live                  # ...the activations this forward keeps
        loss.backward()             # backward frees them: meter.live drops back to 0

    How it counts. Inside the `with`, `saved_tensors_hooks` hands us every tensor autograd saves; we
    box a detached alias of it (same storage, no autograd history: boxing the tensor itself would tie
    an operation's saved output back to the operation, a reference cycle that keeps a dropped graph
    alive) and give the box to autograd. The box lives exactly as long as autograd needs the tensor:
    when backward has used it (or the graph is dropped) autograd lets the box go, and a
    `weakref.finalize` on the box subtracts its bytes. Counting at unpack time would be wrong: unpack
    happens when backward *reads* the tensor, not when it is freed, and never if the graph is dropped.
    Storages are reference-counted, so a tensor saved by two operations (a linear's input that is also
    tanh's output) or a view of a saved tensor counts once.

    Parameters are not activations: a saved tensor whose storage is one of the model's parameters
    (or whose base is a leaf that requires grad, as a parameter gathered by a sharding strategy is)
    is left out. Bytes are what autograd holds, whether or not something else also references them.
    """

    def __init__(self, model: torch.nn.Module | None = None):
        self.model = model
        self._lock = threading.Lock()
        self._live: dict = {}  # storage key -> [boxes alive, bytes]
        self._hooks = None
        self.live = 0
        self.peak = 0

    # --- the context --------------------------------------------------------------------------
    def __enter__(self):
        if self._hooks is not None:
            raise RuntimeError("this ActivationMeter is already active; leave it before entering it again.")
        self._param_keys = self._parameter_storages()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        hooks, self._hooks = self._hooks, None
        return hooks.__exit__(*exc)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.live

    @property
    def saved(self) -> int:
        """How many distinct storages autograd holds for backward now."""
        return len(self._live)

    # --- the hooks ----------------------------------------------------------------------------
    def _parameter_storages(self) -> set:
        if self.model is None:
            return set()
        params = list(self.model.parameters())
        if hasattr(self.model, "memory_groups"):
            params += list(self.model.memory_groups()["params"])
        return {k for p in params if (k := _key(p)) is not None}

    def _is_parameter(self, t: torch.Tensor, key) -> bool:
        if key in self._param_keys:
            return True
        root = t._base if t._base is not None else t
        return root.is_leaf and root.requires_grad

    def _pack(self, t: torch.Tensor):
        key = _key(t)
        if key is None or self._is_parameter(t, key):
            return t
        box = _Saved(t.detach())  # same storage; no grad_fn, so no reference cycle through autograd
        nbytes = t.untyped_storage().nbytes()  # remembered: the storage may be resized before release
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                self._live[key] = [1, nbytes]
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            else:
                entry[0] += 1
        weakref.finalize(box, self._release, key)
        return box

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key) -> None:
        with self._lock:  # may run on an autograd thread
            entry = self._live[key]
            entry[0] -= 1
            if entry[0] == 0:
                self.live -= entry[1]
                del self._live[key]


def record_memory(
    model: torch.nn.Module,
    optimizer=None,
    *,
    step: int | None = None,
    meter: ActivationMeter | None = None,
    recorder=None,
    **extra,
) -> dict:
    """Measure now and add one sample to the trace (labelled with the current phase); return it.

    The sample holds the ledger's categories (not its total), `activations` (the meter's live bytes,
    0 without a meter) and, on CUDA, `cuda_allocated`. `extra` adds more numbers to the sample.
    """
    measured = ledger(model, optimizer)
    measured.pop("total")
    measured["activations"] = meter.live if meter is not None else 0
    measured.update(extra)
    (recorder or _events.recorder).sample(step=step, **measured)
    return measured
