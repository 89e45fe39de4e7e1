"""On a rank of a lab whose ranks talk in collectives (labs 02-12): a process group whose every collective the
grader's relay carries and computes (`relay_meet.py`), so the traffic checks read the grader's record.

`RelayGroup` (`relay_group.py`) carries point-to-point messages and refuses every collective; `CollectiveGroup`
adds them. Each collective torch dispatches to a backend (`dist.all_reduce` -> `allreduce`, `all_gather_into_tensor`
-> `all_gather_single`, `all_to_all_single`, `barrier`, ...; async or not, on any `new_group`) becomes one request:
what kind, on which group (its name and global ranks), the dtype, the elements per rank (`size`), the reduce op, the
root, the split sizes, and this rank's input bytes. Nothing else: the relay checks that every member agrees, computes
the result from what the members handed it, returns each its share, and records what it carried. This side only
packs tensors and unpacks the answer; it decides nothing the grader reads.
"""

from __future__ import annotations

import re
from datetime import timedelta

import torch
import torch.distributed as dist

from .relay_group import RelayGroup, _Work, check_holds

_OPS = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.PRODUCT: "product",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
}


def _bytes(*tensors: torch.Tensor) -> bytes:
    parts = [t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in tensors if t.numel()]
    return b"".join(parts)


def _op(options) -> str:
    op = options.reduceOp
    op = getattr(op, "op", op)  # a ReduceOp wraps its RedOpType
    for known, name in _OPS.items():
        if op == known:
            return name
    raise RuntimeError(
        f"the reduce op {op} is not carried by the grader's relay: use one of {', '.join(_OPS.values())}"
    )


class _Collective(_Work):
    """A collective in flight: done when the relay answers with this rank's share, which it copies into `outputs`
    (in order, each taking its own elements)."""

    def __init__(self, outputs: list, timeout: timedelta):
        super().__init__()
        self.outputs, self.timeout = [t for t in outputs if t.numel()], timeout

    def take(self, payload: bytes) -> None:
        sizes = [t.numel() * t.element_size() for t in self.outputs]
        if len(payload) != sum(sizes):
            raise ValueError(f"{len(payload)} bytes for outputs of {sum(sizes)}")
        check_holds(self.outputs)
        at = 0
        for t, size in zip(self.outputs, sizes):  # copy_ writes a view that is not contiguous too
            t.copy_(torch.frombuffer(bytearray(payload[at : at + size]), dtype=torch.uint8).view(t.dtype).view(t.shape))
            at += size
        self.finish()

    def wait(self, timeout=timedelta(0)) -> bool:
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else 0
        seconds = seconds or self.timeout.total_seconds()
        if not self._done.wait(seconds or None):
            raise RuntimeError(
                f"a collective was not joined by every rank of its group within {seconds:g} s (the grader's relay "
                "waits for every member to call the same collective)"
            )
        if self.error:
            raise RuntimeError(self.error)
        return True

    def result(self) -> list:
        return self.outputs


class CollectiveGroup(RelayGroup):
    """A process group whose collectives (and messages) the grader's relay carries."""

    def __init__(self, link, rank: int, size: int, timeout: timedelta = timedelta(seconds=300)):
        super().__init__(link, rank, size)
        self.timeout = timeout

    def _members(self) -> list[int]:
        if dist.GroupMember.WORLD is self:
            return list(range(self._size))
        return [dist.get_global_rank(self, r) for r in range(self._size)]

    def _call(self, kind: str, tensor: torch.Tensor, size: int, payload: bytes, outputs: list, **extra):
        dtype = str(tensor.dtype).removeprefix("torch.")
        if tensor.device.type != "cpu":
            raise RuntimeError(f"dist.{kind} of a tensor on {tensor.device}: the grader's relay carries CPU tensors")
        message = {
            "op": "collective",
            "kind": kind,
            "group": dist.distributed_c10d._world.pg_names.get(self, ""),
            "members": self._members(),
            "dtype": dtype,
            "size": size,
            **extra,
        }
        self._message(tensor, 0, 0, kind)  # refuses a dtype the relay does not carry
        work = _Collective(outputs, self.timeout)
        return self.link.request(message, payload, work=work)

    def _root(self, options) -> int:
        return self._members()[options.rootRank]

    # --- one tensor in, the same tensor out -----------------------------------------------------------------
    def allreduce(self, tensors, options=None):
        (t,) = tensors
        return self._call("all_reduce", t, t.numel(), _bytes(t), [t], reduce=_op(options or dist.AllreduceOptions()))

    def reduce(self, tensors, options):
        (t,) = tensors
        root = self._root(options)
        mine = [t] if dist.get_rank() == root else []  # only the root's tensor takes the result
        return self._call("reduce", t, t.numel(), _bytes(t), mine, reduce=_op(options), root=root)

    def broadcast(self, tensors, options):
        (t,) = tensors
        root = self._root(options)
        mine = dist.get_rank() == root
        return self._call("broadcast", t, t.numel(), _bytes(t) if mine else b"", [] if mine else [t], root=root)

    def barrier(self, opts=None):
        return self._call("barrier", torch.zeros(0), 0, b"", [])

    # --- gathers: a chunk in, every chunk out ---------------------------------------------------------------
    def _gather(self, kind, outputs: list, t: torch.Tensor, root=None):
        if outputs and sum(o.numel() for o in outputs) != self._size * t.numel():
            raise ValueError(
                f"dist.{kind}: the output holds {sum(o.numel() for o in outputs)} elements, the group's "
                f"{self._size} ranks hand in {self._size} x {t.numel()}"
            )
        return self._call(kind, t, t.numel(), _bytes(t), outputs, **({} if root is None else {"root": root}))

    def allgather(self, output_lists, inputs, options=None):
        return self._gather("all_gather", output_lists[0], inputs[0])

    def all_gather_single(self, output, input, options=None):  # noqa: A002 - torch's names
        return self._gather("all_gather", [output], input)

    _allgather_base = all_gather_single

    def gather(self, output_lists, inputs, options):
        root = self._root(options)
        return self._gather("gather", output_lists[0] if dist.get_rank() == root else [], inputs[0], root)

    # --- scatters: every chunk in, a chunk out --------------------------------------------------------------
    def _scatter(self, kind, output: torch.Tensor, chunks: list, **extra):
        if chunks and sum(c.numel() for c in chunks) != self._size * output.numel():
            raise ValueError(
                f"dist.{kind}: the input holds {sum(c.numel() for c in chunks)} elements, the group's "
                f"{self._size} ranks take {self._size} x {output.numel()}"
            )
        return self._call(kind, output, output.numel(), _bytes(*chunks), [output], **extra)

    def reduce_scatter(self, outputs, input_lists, options=None):
        return self._scatter("reduce_scatter", outputs[0], input_lists[0], reduce=_op(options))

    def reduce_scatter_single(self, output, input, options=None):  # noqa: A002
        return self._scatter("reduce_scatter", output, [input], reduce=_op(options))

    _reduce_scatter_base = reduce_scatter_single

    def scatter(self, outputs, input_lists, options):
        root = self._root(options)
        return self._scatter("scatter", outputs[0], input_lists[0] if dist.get_rank() == root else [], root=root)

    # --- all-to-all: chunk j to rank j ----------------------------------------------------------------------
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, options=None):  # noqa: A002
        n = self._size
        row_in = input.numel() // input.shape[0] if input.dim() and input.shape[0] else 1
        row_out = output.numel() // output.shape[0] if output.dim() and output.shape[0] else 1
        ins = [s * row_in for s in input_split_sizes] if input_split_sizes else [input.numel() // n] * n
        outs = [s * row_out for s in output_split_sizes] if output_split_sizes else [output.numel() // n] * n
        return self._all_to_all(output, [input], [output], ins, outs)

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, options=None):
        return self._all_to_all(inputs[0], inputs, outputs, [t.numel() for t in inputs], [t.numel() for t in outputs])

    def _all_to_all(self, like, inputs, outputs, ins, outs):
        if sum(ins) != sum(t.numel() for t in inputs) or sum(outs) != sum(t.numel() for t in outputs):
            raise ValueError("dist.all_to_all: the split sizes do not add up to the tensors' elements")
        size = sum(ins)
        return self._call("all_to_all", like, size, _bytes(*inputs), outputs, sent=ins, received=outs)


def _refused(name: str):
    def call(self, *args, **kwargs):
        raise RuntimeError(f"dist.{name} is not carried by the grader's relay: call the collective once per tensor")

    return call


for _name in dir(dist.ProcessGroup):  # the coalesced forms (and any collective this torch adds): refused, clearly
    if re.search(r"all|reduce|gather|scatter|broadcast|barrier", _name) and _name not in vars(CollectiveGroup):
        if not _name.startswith("__"):
            setattr(CollectiveGroup, _name, _refused(_name.strip("_")))
