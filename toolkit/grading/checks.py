"""What a lab's `checks.py` is written with: `@check`, the `Context` a check receives, `CheckFailed`.

A check is a function `fn(student, ctx)` that runs on every rank of a real job: `student` is the
student's module, loaded from their file, and `ctx` says who this rank is and offers the comparisons
that turn a wrong answer into a message a student can act on ("rank 1 got [...] expected [...]").
A check passes when it returns on every rank at every world size it asks for.

    @check("ring all-reduce, SUM, float32", points=2, world_sizes=(3, 4))
    def all_reduce_sum(student, ctx):
        x = ...
        student.all_reduce(x, dist.ReduceOp.SUM, ctx.group, False)
        ctx.expect(x, expected, "all_reduce SUM of 7 float32 elements")
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Check:
    """One graded property: its name, what it is worth, the world sizes it runs at, and the test."""

    name: str
    points: int
    world_sizes: tuple[int, ...]
    fn: object
    hidden: bool = False  # defined in the lab's hidden_checks.py: graded, not shipped to students


def check(name: str, points: int = 1, world_sizes=(2, 3, 4)):
    """Decorator that makes a function `fn(student, ctx)` a graded check of a lab."""
    if points < 0 or not world_sizes or min(world_sizes) < 1:
        raise ValueError(f"check {name!r}: points must be >= 0 and world sizes positive.")

    def make(fn) -> Check:
        return Check(name, points, tuple(sorted(set(world_sizes))), fn)

    return make


class CheckFailed(AssertionError):
    """The student's answer is wrong; the message says what differs, on which rank."""


def show(t: torch.Tensor, limit: int = 6) -> str:
    """A short, readable rendering of a tensor's values."""
    values = t.detach().flatten().tolist()
    text = ", ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in values[:limit])
    return f"[{text}{', ...' if len(values) > limit else ''}]"


@dataclass
class Message:
    """One point-to-point message this rank posted: 'send' or 'recv', the peer's global rank, elements."""

    kind: str
    peer: int
    numel: int


_COLLECTIVES = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor",
                "all_gather_object", "all_to_all", "all_to_all_single", "broadcast", "reduce", "gather", "scatter",
                "reduce_scatter_single", "all_gather_single")


@dataclass
class Context:
    """Who this rank is in a check, and the comparisons that explain a failure."""

    rank: int          # global rank
    world_size: int
    group: object      # a fresh group of all ranks: a failed check's stray messages cannot reach the next one

    def fail(self, message: str):
        raise CheckFailed(message)

    def expect(self, got: torch.Tensor, expected: torch.Tensor, what: str, *, exact: bool = True,
               rtol: float = 1e-5, atol: float = 1e-5) -> None:
        """Raise CheckFailed unless `got` equals `expected` (exactly, or within tolerances)."""
        if not isinstance(got, torch.Tensor):
            self.fail(f"{what}: rank {self.rank} got a {type(got).__name__}, expected a tensor")
        if got.shape != expected.shape or got.dtype != expected.dtype:
            self.fail(f"{what}: rank {self.rank} got shape {tuple(got.shape)} {got.dtype}, "
                      f"expected shape {tuple(expected.shape)} {expected.dtype}")
        same = got == expected if exact else torch.isclose(got, expected, rtol=rtol, atol=atol)
        if bool(same.all()):
            return
        wrong = (~same).flatten().nonzero().flatten()
        first = int(wrong[0])
        self.fail(f"{what}: rank {self.rank} got {show(got)} expected {show(expected)} "
                  f"({len(wrong)} of {got.numel()} elements differ; first at element {first}: "
                  f"{got.flatten()[first].item():.6g} instead of {expected.flatten()[first].item():.6g})")

    @contextlib.contextmanager
    def messages(self):
        """Record the point-to-point messages posted inside the block; built-in collectives raise there.

        Yields a list of `Message`, filled as the block runs. Only calls made through the module
        `torch.distributed` (as `dist.isend`, `dist.batch_isend_irecv`, ...) are seen.
        """
        log: list[Message] = []
        real = {name: getattr(dist, name) for name in ("isend", "irecv", "send", "recv", "batch_isend_irecv", "P2POp")}

        def global_peer(peer, group, group_peer) -> int:
            return peer if peer is not None else dist.get_global_rank(group or dist.group.WORLD, group_peer)

        def point_to_point(name):
            signature = inspect.signature(real[name])

            def call(*args, **kwargs):
                a = signature.bind(*args, **kwargs).arguments
                peer = global_peer(a.get("dst", a.get("src")), a.get("group"), a.get("group_dst", a.get("group_src")))
                log.append(Message("send" if "send" in name else "recv", peer, a["tensor"].numel()))
                return real[name](*args, **kwargs)

            call.real = real[name]
            return call

        def p2p_op(op, *args, **kwargs):  # P2POp accepts only the real isend/irecv
            return real["P2POp"](getattr(op, "real", op), *args, **kwargs)

        def batch(ops):
            for op in ops:
                log.append(Message("send" if op.op is real["isend"] else "recv",
                                   global_peer(op.peer, op.group, getattr(op, "group_peer", None)), op.tensor.numel()))
            return real["batch_isend_irecv"](ops)

        def forbidden(name):
            def call(*args, **kwargs):
                raise CheckFailed(f"rank {self.rank} called dist.{name}, which is not allowed here: this lab "
                                  "builds collectives from point-to-point messages (dist.isend/dist.irecv or "
                                  "dist.batch_isend_irecv)")
            return call

        patches = {name: point_to_point(name) for name in ("isend", "irecv", "send", "recv")}
        patches.update(batch_isend_irecv=batch, P2POp=p2p_op)
        patches.update({name: forbidden(name) for name in _COLLECTIVES if hasattr(dist, name)})
        saved = {name: getattr(dist, name) for name in patches}
        try:
            for name, fn in patches.items():
                setattr(dist, name, fn)
            yield log
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)
