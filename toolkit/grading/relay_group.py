"""On a rank of a lab that builds collectives from point-to-point messages: a process group with no collective in
it, whose messages the grader carries (`relay.py`).

A rank of `toolkit.launch` starts on a gloo process group: every built-in collective is one call away, however a
task patches `torch.distributed` (a submission captures `dist.all_reduce` at import, or calls the group's own
`allreduce` binding). So before the submission is imported, `switch` tears that group down (its sockets closed,
its rendezvous store let go), and makes the default group a `RelayGroup`: a `torch.distributed.ProcessGroup`
whose only operations are `send` and `recv` (`dist.send`, `recv`, `isend`, `irecv`, `batch_isend_irecv` and
`new_group` work as on gloo; every collective raises; in the other labs its subclass `relay_collectives.CollectiveGroup`
carries the collectives too), each one a request on a socket to the grader's relay. The
relay matches a send with its receive (a blocking send waits for it, as gloo's does: a ring of blocking sends
deadlocks here too), delivers the tensor and keeps the record the traffic checks read. Nothing else connects
the ranks: the store the group is made with is the rank's own (`relay_store.Agreeing`: every rendezvous is already met,
since the relay holds a message until its receiver asks), and after the switch the rank may open no socket
(`sandbox.no_new_channels`).
"""

from __future__ import annotations

import re
import socket
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from ..parallel.flat import holds
from .relay_frames import read_frame, send_frame  # the frames both ends speak
from .relay_store import Agreeing
from .wire import DTYPES  # the tensors' dtypes a message may carry, as an answer may

BACKEND = "toolkit_relay"


def check_holds(tensors) -> None:
    """Refuse (ValueError) to write into a tensor whose storage no longer holds every element the view reaches: the
    relay's answers are written from its thread, and memory freed meanwhile (FSDP frees a flat parameter by resizing
    its storage to 0 bytes, the view keeping its shape) would be written all the same, crashing the rank or changing
    another tensor's bytes, in this check or a later one of the same launch."""
    for t in tensors:
        if not holds(t):
            raise ValueError(
                f"the tensor of {tuple(t.shape)} it was to fill has no memory any more (its storage holds "
                f"{t.untyped_storage().nbytes()} bytes): it was freed or resized while the message was in flight; "
                "wait for a collective or a receive before freeing what it writes into"
            )


class _Work(dist._Work):
    """A message in flight: done when the relay says the receiver took it (a send) or it arrived (a receive)."""

    def __init__(self, tensor: torch.Tensor | None = None):
        super().__init__()
        self.tensor, self.error, self.payload = tensor, None, b""
        self._done, self._futures, self._lock, self._finished = threading.Event(), [], threading.Lock(), False

    def finish(self, error: str | None = None) -> None:
        """Settle the futures handed out, then wake the waiters: a waiter that goes on to free the tensors (FSDP's
        reshard) must not race a future still reading them on this thread."""
        with self._lock:
            self.error, self._finished = error, True
            futures, self._futures = self._futures, []
        for future in futures:
            self._settle(future)
        self._done.set()

    def result(self) -> list:
        return [self.tensor] if self.tensor is not None else []

    def _settle(self, future) -> None:
        if self.error:
            future.set_exception(RuntimeError(self.error))
        else:
            future.set_result(self.result())

    def take(self, payload: bytes) -> None:
        """The relay's answer: a received message's bytes into its tensor."""
        if self.tensor is not None and payload:
            check_holds([self.tensor])
            flat = self.tensor.view(-1)
            flat.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(flat.dtype))
        self.payload = payload
        self.finish()

    def wait(self, timeout=timedelta(0)) -> bool:
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else 0
        if not self._done.wait(seconds or None):
            raise RuntimeError(f"a point-to-point message was not matched within {seconds:g} s")
        if self.error:
            raise RuntimeError(self.error)
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and not self.error

    def get_future(self):
        """Completed when the relay answers (never waited for here: an async call returns at once)."""
        future = torch.futures.Future()
        with self._lock:
            if not self._finished:
                self._futures.append(future)
                return future
        self._settle(future)
        return future


class _Link:
    """This rank's one connection to the relay, shared by all its groups; a thread reads the relay's answers."""

    def __init__(self, sock: socket.socket):
        self.sock, self.lock, self.pending, self.next = sock, threading.Lock(), {}, 0
        self.lost = ""
        self.collectives = 0  # posted in this check: where `Rank.events_now` marks the relay's record
        threading.Thread(target=self._answers, daemon=True, name="grading-relay").start()

    def request(self, message: dict, payload: bytes = b"", tensor: torch.Tensor | None = None, work=None) -> _Work:
        work = _Work(tensor) if work is None else work
        with self.lock:
            if self.lost:
                raise RuntimeError(self.lost)
            self.next += 1
            self.collectives += message["op"] == "collective"
            message["id"] = self.next
            self.pending[self.next] = work
            send_frame(self.sock, message, payload)
        return work

    def _answers(self) -> None:
        while True:
            try:
                frame = read_frame(self.sock, 1 << 31)
            except (OSError, ValueError):
                frame = None
            if frame is None:
                with self.lock:
                    self.lost = "the grader's relay closed the connection (the launch is ending)"
                    for work in self.pending.values():
                        work.finish(self.lost)
                    self.pending.clear()
                return
            answer, payload = frame
            work = self.pending.pop(answer.get("id"), None)
            if work is None:
                continue
            if answer.get("error"):
                work.finish(answer["error"])
                continue
            try:
                work.take(payload)
            except (RuntimeError, ValueError) as exc:
                work.finish(f"the grader's relay answered what this rank cannot take ({exc})")


class RelayGroup(dist.ProcessGroup):
    """A process group whose messages the grader's relay carries, and which has no collective."""

    def __init__(self, link: _Link, rank: int, size: int, timeout: timedelta | None = None):
        super().__init__(rank, size)  # timeout: the group's, as torch hands it; a message waits as gloo's does
        self.link, self._rank, self._size = link, rank, size

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:
        return BACKEND

    def _set_group_name(self, name: str) -> None:  # torch names every group; its C++ half keeps no name for us
        self._name = name

    @property
    def group_name(self) -> str:
        return getattr(self, "_name", "")

    def _global(self, group_rank: int) -> int:
        return group_rank if dist.GroupMember.WORLD is self else dist.get_global_rank(self, group_rank)

    def _message(self, tensor: torch.Tensor, peer: int, tag: int, way: str) -> dict:
        if str(tensor.dtype).removeprefix("torch.") not in DTYPES:
            raise TypeError(f"dist.{way} of a {tensor.dtype} tensor: the grader's relay carries {', '.join(DTYPES)}")
        name = dist.distributed_c10d._world.pg_names.get(self, "")  # the same on every member (its ranks, its order)
        return {
            "op": way,
            "peer": peer,
            "group": name,
            "tag": tag,
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "numel": tensor.numel(),
        }

    def send(self, tensors, dstRank, tag):  # noqa: N803 - torch's names
        (tensor,) = tensors
        data = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        return self.link.request(self._message(tensor, self._global(dstRank), tag, "send"), data)

    def recv(self, tensors, srcRank, tag):  # noqa: N803
        (tensor,) = tensors
        if not tensor.is_contiguous():
            raise ValueError("dist.recv into a tensor that is not contiguous: receive into a contiguous buffer")
        return self.link.request(self._message(tensor, self._global(srcRank), tag, "recv"), tensor=tensor)

    def recv_anysource(self, tensors, tag):
        raise RuntimeError("dist.recv without a source is not supported here: name the rank you receive from")


def _refused(name: str):
    def call(self, *args, **kwargs):
        raise RuntimeError(
            f"{name} is not allowed here: this lab builds collectives from point-to-point messages "
            "(dist.isend/dist.irecv or dist.batch_isend_irecv), and the grader's process group has "
            "no built-in collective"
        )

    return call


for _name in dir(dist.ProcessGroup):  # every collective torch's process group binds, in this version of torch
    if re.search(r"all|reduce|gather|scatter|broadcast|barrier", _name) and not _name.startswith("__"):
        setattr(RelayGroup, _name, _refused(f"the built-in collective {_name.strip('_')}"))


_KEPT: list = []


def connect(path: str, rank: int, token: str) -> _Link:
    """This rank's link to the grader's relay at `path` (as `rank`, with the `token` only the grader and this rank
    know): every lab's ranks take their checks' inputs and hand in their results through it."""
    link_socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    link_socket.connect(path)
    send_frame(link_socket, {"op": "hello", "rank": rank, "token": token})
    return _Link(link_socket)


def switch(link: _Link, rank: int, world_size: int, group: type | None = None) -> _Link:
    """Tear down this rank's gloo group and store, and make a `group` (a RelayGroup, the default, or a subclass:
    `relay_collectives.CollectiveGroup` has the relay carry the collectives too) on `link` the default group."""
    group = group or RelayGroup
    if dist.is_initialized():
        dist.destroy_process_group()  # gloo's sockets closed; the rendezvous store let go with it
    name = BACKEND if group is RelayGroup else f"{BACKEND}_{group.__name__.lower()}"
    if name.upper() not in dist.Backend._plugins:

        def make(store, group_rank, group_size, timeout):
            return group(link, group_rank, group_size, timeout)

        dist.Backend.register_backend(name, make, devices=["cpu"])
    _KEPT.append(Agreeing(link))  # a Python store lives as long as its Python object: torch holds only the C++ half
    dist.init_process_group(name, store=_KEPT[-1], rank=rank, world_size=world_size)
    return link


def inputs(link: _Link, index) -> dict:
    """The inputs of check `index`, from the relay (which gives them only once the previous result is in)."""
    from . import wire

    link.collectives = 0  # a new check: the relay's record of it starts empty
    work = link.request({"op": "inputs", "index": str(index)})
    work.wait()
    return wire.decode(work.payload)


def ready(link: _Link) -> None:
    """Tell the grader this rank is about to import the submission (nothing of it has run yet)."""
    link.request({"op": "ready"}).wait()


def hand_in(link: _Link, data: bytes) -> None:
    """This rank's result of the check it took the inputs of: the first one handed in is the one the grader uses."""
    link.request({"op": "result"}, data).wait()
