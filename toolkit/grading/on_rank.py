"""What a lab's `tasks.py` is written with: the `Rank` a task receives, on a rank that runs student code.

A task is `fn(student, rank, given) -> observations`: it calls the student's functions on `given` (this rank's
inputs, sent by the grader) and returns what happened (tensors, numbers, and, as `rank.comm_events`, a mark the
grader replaces with the collectives its relay carried). It decides nothing: no expected value lives here, because
this process runs the student's code. The grader's side (`checks.py`) judges what the tasks returned. A task may
raise (the student's code failed): the grader reports the exception, with the line of the student's file.

    def all_reduce(student, rank, given):
        x = given["x"].clone()
        student.all_reduce(x, dist.ReduceOp.SUM, rank.group, False)
        return {"x": x}
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch.distributed as dist

_COLLECTIVES = (
    "all_reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "reduce_scatter_single",
    "all_gather_single",
)


@dataclass
class Rank:
    """Who this rank is in a task, and what it can record."""

    rank: int  # global rank
    world_size: int
    group: object  # a fresh group of all ranks: a failed check's stray messages cannot reach the next one
    relay: object = None  # the link to the grader's relay, where it carries this lab's collectives (labs 02-12)

    def comm_events(self, start: int = 0) -> list[dict] | dict:
        """The collectives this rank took part in since `start` (`events_now()` before), each as {"name",
        "args"}: what the grader reads to count collectives and bytes. Where the grader's relay carries the
        collectives, this is a mark (`{"relay_span": [start, now]}`) that the grader replaces with its own record
        of the collectives it carried for this rank in that span of the check (`relay_meet.entry`): return it as
        it is, and count in the checks. Else the ones `toolkit.comm` recorded on this rank."""
        if self.relay is not None:
            return {"relay_span": [start, self.relay.collectives]}
        return self.local_events(start)

    def events_now(self) -> int:
        """Where `comm_events` starts counting now."""
        return self.relay.collectives if self.relay is not None else self.local_now()

    @staticmethod
    def local_events(start: int = 0) -> list[dict]:
        """What `toolkit.comm` recorded on this rank since `start` (`local_now()` before): the rank's own word, for
        what no relay sees (a call's `async_op`, its label); never the traffic a check counts."""
        from ..trace.events import recorder

        return [
            {"name": e["name"], "args": dict(e.get("args", {}))}
            for e in recorder.events[start:]
            if e.get("cat") == "comm"
        ]

    @staticmethod
    def local_now() -> int:
        from ..trace.events import recorder

        return len(recorder.events)

    @contextlib.contextmanager
    def messages(self):
        """Record the point-to-point messages posted inside the block; built-in collectives raise there.

        Yields a list filled as the block runs, one ("send" | "recv", peer's global rank, elements) per
        message. Only calls made through the module `torch.distributed` (`dist.isend`, ...) are seen, and the
        list is made in the submission's process: in a lab that declares `MESSAGES_ONLY = True`, the grader
        puts in its place, under `messages` in what the task returns, the record of every message its relay
        carried for this rank during the check (`relay.py`), and no built-in collective exists to call.
        """
        log: list[list] = []
        real = {name: getattr(dist, name) for name in ("isend", "irecv", "send", "recv", "batch_isend_irecv", "P2POp")}

        def global_peer(peer, group, group_peer) -> int:
            return peer if peer is not None else dist.get_global_rank(group or dist.group.WORLD, group_peer)

        def point_to_point(name):
            signature = inspect.signature(real[name])

            def call(*args, **kwargs):
                a = signature.bind(*args, **kwargs).arguments
                peer = global_peer(a.get("dst", a.get("src")), a.get("group"), a.get("group_dst", a.get("group_src")))
                log.append(["send" if "send" in name else "recv", peer, a["tensor"].numel()])
                return real[name](*args, **kwargs)

            call.real = real[name]
            return call

        def p2p_op(op, *args, **kwargs):  # P2POp accepts only the real isend/irecv
            return real["P2POp"](getattr(op, "real", op), *args, **kwargs)

        def batch(ops):
            for op in ops:
                log.append(
                    [
                        "send" if op.op is real["isend"] else "recv",
                        global_peer(op.peer, op.group, getattr(op, "group_peer", None)),
                        op.tensor.numel(),
                    ]
                )
            return real["batch_isend_irecv"](ops)

        def forbidden(name):
            def call(*args, **kwargs):
                log.append(["collective", name, 0])
                raise RuntimeError(
                    f"dist.{name} is not allowed here: this lab builds collectives from "
                    "point-to-point messages (dist.isend/dist.irecv or dist.batch_isend_irecv)"
                )

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
