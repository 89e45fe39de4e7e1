"""Recording a simulated step as a program: compute segments cut at every call to the collectives door.

`OpCounter` below watches every aten operation the rank runs: its FLOPs (from torch's `flop_registry`, the counts
`FlopCounterMode` makes, which add up to `Simulation.flops`), the bytes of its inputs and outputs (what a
memory-bound kernel would read and write; an indexing kernel's `Kernel` only what its index names), and the
operation as a `Kernel` (a GEMM's or an attention's shape), which the cost model prices one by one. It holds no
tensor and hooks no module: `FlopCounterMode`'s module tracker registers gradient hooks on every module's outputs,
and under activation checkpointing the recomputed outputs' graph then references itself through them (node -> hook
-> node), so every recomputed activation stayed alive until the garbage collector ran (GPT-3 fsdp x512,
checkpointed: 59.7 GB where FSDP2 + FSDPMemTracker read 26.2 GB; 26.2 GB without it, `bench/memory_fsdp2.py
--gpt3`).
The running module's name comes from the memory tracker's own `ModTracker` instead. The door tells `Programmer`
when a collective is issued and when the rank waits on one (`toolkit.comm.listening`); each time, the
work since the last cut becomes a `Compute`, then the call becomes a `Collective` or a `Wait`.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, shape_wrapper

from ..trace.events import current_phase
from .attention import FLOPS as ATTENTION_FLOPS
from .known_shapes import Memo, shape_key
from .program import DTYPES, Collective, Compute, Kernel, Wait

_NOT_COMPUTE = {"c10d", "_c10d_functional", "c10d_functional"}  # a collective is not compute work
_FLOPS = {**flop_registry, **{k: shape_wrapper(v) for k, v in ATTENTION_FLOPS.items()}}  # as FlopCounterMode's
aten = torch.ops.aten
_GEMMS = {aten.mm: 0, aten.addmm: 1, aten.bmm: 0, aten.baddbmm: 1}  # op -> index of its first factor
_KERNELS = Memo()
_NO_DEVICE_WORK = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "detach",
    "alias",
    "lift_fresh",
    "_unsafe_view",
    "_record_function_enter_new",
    "_record_function_exit",
}  # metadata only


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def indexed_bytes(name: str, args, out) -> int | None:
    """What an indexing kernel moves: its index and the elements the index names, read and written, not the whole
    tensor it indexes into (a gather of one logit a token out of (tokens x V) logits reads `tokens` of them; an
    in-place scatter-add writes as many). None for any other operation."""
    if name in ("gather", "index_select", "embedding"):
        return _nbytes(args[1] if name == "embedding" else args[2]) + 2 * _nbytes(out)
    if name in ("scatter_add_", "scatter_"):
        index = args[2]
        return _nbytes(index) + _nbytes(args[3] if len(args) > 3 else None) + 2 * index.numel() * args[0].element_size()
    return None


def kernel_of(func, args, kwargs, out, nbytes: int) -> Kernel:
    """The `Kernel` record of one aten call: a GEMM's (batch, m, n, k), a fused attention's shape, else its bytes."""
    packet = func._overloadpacket
    flops = float(_FLOPS[packet](*args, **kwargs, out_val=out)) if packet in _FLOPS else 0.0
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    floating = [t for t in tensors if t.is_floating_point()]
    dtype = DTYPES.get(str(floating[0].dtype).replace("torch.", ""), "other") if floating else "other"
    name = packet.__name__
    if name in _NO_DEVICE_WORK:
        return Kernel(name, "other", 0.0, 0.0, dtype)
    if packet in _GEMMS:
        a, b = args[_GEMMS[packet]], args[_GEMMS[packet] + 1]
        batch = a.shape[0] if a.dim() == 3 else 1
        if _GEMMS[packet] and kwargs.get("beta", args[3] if len(args) > 3 else 1) == 0:  # C = alpha AB: C not read
            nbytes -= args[0].numel() * args[0].element_size()
        return Kernel(name, "gemm", flops, float(nbytes), dtype, (batch, a.shape[-2], b.shape[-1], a.shape[-1]))
    if name.startswith("_scaled_dot_product") and "attention" in name:
        named = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
        q, k = named["query"], named["key"]
        shape = (
            q.shape[0],
            q.shape[1],
            q.shape[2],
            k.shape[2],
            q.shape[3],
            bool(named.get("is_causal")),
            "backward" in name,
        )
        return Kernel(name, "attention", flops, float(nbytes), dtype, tuple(int(x) for x in shape[:5]) + shape[5:])
    indexed = indexed_bytes(name, args, out)
    return Kernel(name, "other", flops, float(nbytes if indexed is None else indexed), dtype)


class OpCounter(TorchDispatchMode):
    """Counts aten operations, their FLOPs and the bytes of their tensor inputs and outputs (views move
    nothing), and keeps each operation's `Kernel` until `take_kernels()`."""

    def __init__(self, meta: bool = False):
        super().__init__()
        self.known = _KERNELS if meta else None  # on meta tensors: shape_key -> (bytes, Kernel)
        self.ops = 0
        self.flops = 0.0
        self.bytes = 0
        self.kernels: dict = {}  # Kernel -> count, since the last take_kernels()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace in _NOT_COMPUTE:
            return out
        self.ops += 1  # every operation the host dispatches costs it a dispatch, a view's too
        if not func.is_view:
            key = shape_key(func, args, kwargs) if self.known is not None else None
            seen = self.known.get(key) if key is not None else None
            if seen is None:  # a new operation or shape: its bytes and Kernel depend on nothing else
                nbytes = sum(
                    t.numel() * t.element_size()
                    for t in tree_flatten((args, kwargs, out))[0]
                    if isinstance(t, torch.Tensor)
                )
                seen = (nbytes, kernel_of(func, args, kwargs, out, nbytes))
                if key is not None:
                    self.known[key] = seen
            nbytes, kernel = seen
            self.bytes += nbytes
            self.flops += kernel.flops
            self.kernels[kernel] = self.kernels.get(kernel, 0) + 1
        return out

    def take_kernels(self) -> tuple:
        """((Kernel, count), ...) since the last call, in first-seen order."""
        taken, self.kernels = tuple(self.kernels.items()), {}
        return taken


class Programmer:
    """Listens to the door and cuts the rank's work into a program (one per step, see `program.py`)."""

    def __init__(self, ops: OpCounter, module):
        self.ops, self.module = ops, module  # module(): the innermost module running now ("" outside them)
        self.program: list = []
        self._issued: dict = {}  # id(trace event) -> collective id, this step
        self._mark = (0, 0, 0)  # flops, ops, bytes at the last cut
        self._open: list = []  # the strategy's spans open now: (key, event), outermost first
        self._keys = 0

    def start_step(self) -> None:
        self.cut()
        self.program, self._issued = [], {}

    def cut(self, label: str | None = None) -> None:
        """Close the compute segment running since the last cut (nothing when it ran no operation)."""
        now = (self.ops.flops, self.ops.ops, self.ops.bytes)
        flops, ops, nbytes = (a - b for a, b in zip(now, self._mark))
        self._mark = now
        kernels = self.ops.take_kernels()
        if ops:
            spans = tuple((key, e["name"], e["cat"], dict(e["args"])) for key, e in self._open)
            self.program.append(
                Compute(
                    flops=float(flops),
                    bytes=float(nbytes),
                    phase=current_phase(),
                    label=self.module() if label is None else label,
                    ops=ops,
                    spans=spans,
                    kernels=kernels,
                )
            )

    def span(self, kind: str, event: dict) -> None:
        """A compute span of the strategy's (an FSDP unit's pass, a MoE layer's experts) opens or closes: cut
        there, so the segments inside know it (`toolkit.trace.recorder.listening`)."""
        if event["cat"] not in ("compute", "fsdp"):
            return
        self.cut()
        if kind == "open":
            self._keys += 1
            self._open.append((self._keys, event))
        else:
            self._open = [(key, e) for key, e in self._open if e is not event]

    def __call__(self, kind: str, event: dict, tensor=None) -> None:
        self.cut()
        if kind == "issue":
            self._issued[id(event)] = len(self._issued)
            self.program.append((event, self.module()))  # a Collective at the end of the step:
            #                                                    callers annotate the event after the call
        elif id(event) in self._issued:  # (a wait on a collective of an earlier step is not this step's)
            self.program.append(Wait(self._issued[id(event)], phase=current_phase()))

    def end_step(self) -> list:
        """The step's program: Compute, Collective and Wait in the order they happened."""
        self.cut()
        program = [self._collective(*i) if isinstance(i, tuple) else i for i in self.program]
        self.program = []
        return program

    def _collective(self, event: dict, module: str) -> Collective:
        a = event["args"]
        label = a.get("unit") or a.get("moe") or module  # the unit or MoE step, else the module issuing it
        return Collective(
            id=self._issued[id(event)],
            op=event["name"],
            size_bytes=a["size_bytes"],
            bytes_sent=a["bytes_sent"],
            bytes_recv=a["bytes_recv"],
            group=tuple(a["group"]),
            async_op=bool(a["async_op"]),
            phase=event["phase"],
            label=str(label),
            args=dict(a),
        )
