"""One simulated rank's training step as a program: compute and communication, in the order issued.

On the simulated cluster (torch's fake process group, meta tensors) every collective completes at
once and no kernel runs, so the simulator cannot record *time*. What it records exactly is what the
strategy's own code asked for, and in which order:

- `Compute`: the operations run between two calls to the collectives door (or two edges of the
  strategy's own spans), with their FLOPs (torch's `flop_registry`, the counts `FlopCounterMode` makes), the
  bytes they read and wrote, the spans open around them, and each operation itself (`Kernel`: a GEMM's
  shape, an attention's, or an elementwise op's bytes), which the cost model prices one by one;
- `Collective`: a call to the door (operation, bytes, the global ranks of its group, whether it was
  asynchronous), issued when the compute before it had been issued;
- `Wait`: the moment this rank blocks until collective `id` is complete (a synchronous collective is
  a `Collective` followed at once by its `Wait`).

The cost model (`toolkit.sim.cost`) turns a program into a timeline: compute on one stream,
collectives on the communication stream from issue until complete, a `Wait` stalls compute. This file
is the interface between the two halves and holds no logic beyond what reading a program needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Kernel:
    """One aten operation as the cost model prices it (`toolkit.sim.kernel_time`); equal ones are counted once.

    kind "gemm": shape (batch, m, n, k), an (m x k) by (k x n) product, `batch` of them; "attention": a fused
    attention kernel, shape (batch, heads, queries, keys, head_dim, causal, backward); "other": everything
    else, priced by its bytes (and FLOPs where torch counts any)."""

    name: str  # the aten op ("addmm", "bmm", "native_layer_norm", ...)
    kind: str  # "gemm", "attention" or "other"
    flops: float
    bytes: float  # of its tensor inputs and outputs
    dtype: str  # of its first floating-point input: "bf16", "fp16", "fp32", ...
    shape: tuple = ()


@dataclass(frozen=True)
class Compute:
    """Work on the compute stream between two door calls."""

    flops: float  # floating-point operations of the ops in this segment
    bytes: float = 0.0  # bytes the ops read and wrote (for memory-bound ops); 0 where unknown
    phase: str = "idle"  # the training phase: "forward", "backward", "optimizer", "setup", ...
    label: str = ""  # what a real trace would call it (a unit, a module, "optimizer")
    ops: int = 0  # how many aten operations the segment holds
    spans: tuple = field(default=(), compare=False)  # the strategy's spans open around it, outermost first:
    #                         (key, name, cat, args) as a real trace records them ("forward blocks.0", "moe/…/experts")
    kernels: tuple = field(default=(), compare=False)  # ((Kernel, count), ...): its operations; () where only
    #                         the totals are known (a hand-written program): priced as one roofline

    @property
    def views_only(self) -> bool:
        """Operations the host dispatched, none of them a kernel: views and metadata between two door calls
        (a recorded program's), work for the host alone."""
        return self.ops > 0 and not (self.kernels or self.flops or self.bytes)


@dataclass(frozen=True)
class Collective:
    """A call to the collectives door, as `toolkit.comm` records it for a real run."""

    id: int  # issue order within the step, from 0
    op: str  # all_reduce, reduce_scatter, all_gather, broadcast, all_to_all, send, recv, barrier
    size_bytes: int  # the message size the door records (`args.size_bytes`)
    bytes_sent: int  # what this rank puts on the wire (ring algorithm accounting)
    bytes_recv: int  # what this rank takes off the wire
    group: tuple  # global ranks of the group, in group order
    async_op: bool
    phase: str = "idle"
    label: str = ""
    args: dict = field(default_factory=dict, compare=False)  # the door's extra args (splits, dtype, unit)


@dataclass(frozen=True)
class Wait:
    """This rank's compute stream blocks here until collective `id` has completed."""

    id: int
    phase: str = "idle"


Instruction = Compute | Collective | Wait
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def collectives(program) -> list[Collective]:
    return [i for i in program if isinstance(i, Collective)]


def total_flops(program) -> float:
    return sum(i.flops for i in program if isinstance(i, Compute))


def check(program) -> None:
    """A program is well formed when every Wait follows its Collective, and ids are issue order."""
    issued = set()
    for n, instruction in enumerate(program):
        if isinstance(instruction, Collective):
            if instruction.id in issued:
                raise ValueError(f"instruction {n}: collective id {instruction.id} issued twice")
            issued.add(instruction.id)
        elif isinstance(instruction, Wait) and instruction.id not in issued:
            raise ValueError(f"instruction {n}: waits on collective {instruction.id} before it was issued")
