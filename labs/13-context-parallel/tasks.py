"""What every rank runs for lab 13's checks, next to your code: your merge on the blocks the grader sent, and your
rings on this rank's queries, keys and values, with a record of what happened in order (every message posted and
waited for, every block attended). Nothing here knows the right answer: the grader's process judges what these
return (checks.py), and what it counts of your traffic is what its relay carried, not this record.

One thing is decided here, because it must be decided before anything hangs: a wait that can only deadlock. Every
rank of a ring runs the same code, so when this rank waits for its k-th value to arrive before it has posted k
values to send, its previous rank, at the same point, has not sent them either: each waits for a message no rank
has posted (and the same for a send waited for before as much is posted to receive). Such a wait, and a blocking
`dist.send` or `dist.recv`, raise at once with a message saying so.
"""

import inspect

import torch.distributed as dist


def merge(student, rank, given):
    out, lse = student.merge(given["out1"], given["lse1"], given["out2"], given["lse2"])
    return {"out": out, "lse": lse}


def forward(student, rank, given, group=None):
    with Recorded(student):
        out, lse = student.ring_forward(given["q"], given["k"], given["v"], given["causal"], group or rank.group)
    return {"out": out, "lse": lse}


def backward(student, rank, given, group=None):
    with Recorded(student):
        dq, dk, dv = student.ring_backward(
            given["grad"],
            given["q"],
            given["k"],
            given["v"],
            given["out"],
            given["lse"],
            given["causal"],
            group or rank.group,
        )
    return {"dq": dq, "dk": dk, "dv": dv}


def traffic_forward(student, rank, given):
    with Recorded(student) as record:
        student.ring_forward(given["q"], given["k"], given["v"], given["causal"], rank.group)
    return {"messages": record.messages()}


def traffic_backward(student, rank, given):
    with Recorded(student) as record:
        student.ring_backward(
            given["grad"], given["q"], given["k"], given["v"], given["out"], given["lse"], given["causal"], rank.group
        )
    return {"messages": record.messages()}


def overlap(student, rank, given):
    """Both rings, one after the other, recorded as one sequence of events."""
    with Recorded(student) as record:
        student.ring_forward(given["q"], given["k"], given["v"], given["causal"], rank.group)
        record.events.append(["phase", "backward", 0])
        student.ring_backward(
            given["grad"], given["q"], given["k"], given["v"], given["out"], given["lse"], given["causal"], rank.group
        )
    return {"events": record.events}


def subgroups(student, rank, given):
    """Both rings on this rank's group of `given["groups"]` (rings of global ranks, one of them a ring of one)."""
    group, _ = dist.new_subgroups_by_enumeration(given["groups"])
    return {**forward(student, rank, given, group), **backward(student, rank, given, group)}


# --- the record ------------------------------------------------------------------------------------------------
class Recorded:
    """`with Recorded(student) as record:` notes, in order, in `record.events`: ["send" | "recv", peer's global rank,
    elements] for each message posted, ["wait", the index of the message's event, 0] for each wait, ["attend",
    "forward" | "backward", 0] for each block attended through the given `attend` / `attend_backward`. A wait that
    can only deadlock, and a blocking send or receive, raise (the module's docstring says why)."""

    P2P = ("isend", "irecv", "send", "recv", "batch_isend_irecv", "P2POp")

    def __init__(self, student):
        self.student, self.events = student, []
        self.posted = {"send": 0, "recv": 0}  # elements
        self.through = {}  # a message's event -> the elements of its kind posted up to it, itself included

    def messages(self) -> list:
        return [e for e in self.events if e[0] in ("send", "recv")]

    def __enter__(self):
        self.saved = {name: getattr(dist, name) for name in self.P2P}
        self.given = {name: getattr(self.student, name, None) for name in ("attend", "attend_backward")}
        real = self.saved
        posting = {name: self._posting(name, real[name]) for name in ("isend", "irecv")}
        dist.isend, dist.irecv = posting["isend"], posting["irecv"]
        dist.send, dist.recv = self._blocking("send"), self._blocking("recv")
        dist.P2POp = lambda op, *args, **kwargs: real["P2POp"](getattr(op, "real", op), *args, **kwargs)
        dist.batch_isend_irecv = self._batch(real["batch_isend_irecv"], real["isend"])
        for name, fn in self.given.items():
            if callable(fn):
                setattr(self.student, name, self._attending(fn, "forward" if name == "attend" else "backward"))
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)
        for name, fn in self.given.items():
            if fn is not None:
                setattr(self.student, name, fn)

    def _post(self, kind: str, peer: int, tensor) -> int:
        self.events.append([kind, int(peer), int(tensor.numel())])
        self.posted[kind] += tensor.numel()
        self.through[len(self.events) - 1] = self.posted[kind]
        return len(self.events) - 1

    def _posting(self, name, real):
        signature, kind = inspect.signature(real), "send" if name == "isend" else "recv"

        def call(*args, **kwargs):
            a = signature.bind(*args, **kwargs).arguments
            work = real(*args, **kwargs)
            peer = _global(a.get("dst", a.get("src")), a.get("group"), a.get("group_dst", a.get("group_src")))
            return Waited(work, self._post(kind, peer, a["tensor"]), self)

        call.real = real
        return call

    def _batch(self, real, real_isend):
        def call(ops):
            works = real(ops)
            return [
                Waited(
                    work,
                    self._post(
                        "send" if op.op is real_isend else "recv",
                        _global(op.peer, op.group, getattr(op, "group_peer", None)),
                        op.tensor,
                    ),
                    self,
                )
                for op, work in zip(ops, works)
            ]

        return call

    def _blocking(self, name):
        def call(tensor, peer=None, *args, **kwargs):
            towards = "to" if name == "send" else "from"
            raise RuntimeError(
                f"dist.{name} {towards} rank {peer} blocks until that rank has posted the matching "
                f"{'receive' if name == 'send' else 'send'}. In a ring every rank does the same at the same moment, "
                "so each would wait for a neighbour that is itself waiting: a deadlock (named here before it "
                "happens), and a blocking call overlaps nothing. Post each pass with dist.isend and dist.irecv (or "
                "dist.batch_isend_irecv), attend the block you hold, then wait() for both."
            )

        return call

    def waiting(self, index: int) -> None:
        kind, peer, _ = self.events[index]
        other = "recv" if kind == "send" else "send"
        if self.posted[other] < self.through[index]:
            what = (
                f"until {self.through[index]} values have come from rank {peer}, before it has posted as many to "
                f"send ({self.posted['send']} so far)"
                if kind == "recv"
                else f"until the {self.through[index]} values it sent to rank {peer} are taken, before it has posted "
                f"as many to receive ({self.posted['recv']} so far)"
            )
            raise RuntimeError(
                f"this rank waits {what}. Every rank of the ring runs the same code, so its neighbour, at the same "
                "point, has not posted the other half either: each waits for a message no rank has posted, a "
                "deadlock (named here before it happens). Post each pass's dist.isend and dist.irecv together, then "
                "attend, then wait."
            )
        self.events.append(["wait", index, 0])

    def _attending(self, fn, direction: str):
        def call(*args, **kwargs):
            self.events.append(["attend", direction, 0])
            return fn(*args, **kwargs)

        return call


class Waited:
    """A posted message: its wait() is recorded (and refused where it can only deadlock); once it has returned, a
    second wait returns at once (gloo's would block for ever)."""

    def __init__(self, work, index: int, record: Recorded):
        self._work, self._index, self._record, self._done = work, index, record, False

    def wait(self, *args, **kwargs):
        self._record.waiting(self._index)
        if not self._done:
            self._work.wait(*args, **kwargs)
            self._done = True
        return True

    def __getattr__(self, name):
        return getattr(self._work, name)


def _global(peer, group, group_peer) -> int:
    return peer if peer is not None else dist.get_global_rank(group or dist.group.WORLD, group_peer)
