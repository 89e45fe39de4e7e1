"""What an issued collective is: a `Handle` to wait on, whose end is marked on the trace, and the error a failed
call becomes (naming the call, and whether this rank caused it or is a casualty of another)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..runtime import status
from ..runtime.blame import Consequence, is_consequence
from ..trace.events import recorder
from . import emulate as _emulation
from .listeners import tell

_side_stream = None


def _marker_stream():
    """One side stream per process on which the ends of asynchronous collectives are marked."""
    global _side_stream
    if _side_stream is None:
        _side_stream = torch.cuda.Stream()
    return _side_stream


class Handle:
    """What an asynchronous collective returns: `wait()` blocks until the result is in place.

    Under an emulated link (`toolkit.comm.emulate`) the result is in place only at the call's modelled
    completion (`deadline`): `wait()` sleeps what remains of it, `is_completed()` is False before it.
    """

    def __init__(self, work, event, after=None, deadline=None, entry=None):
        self._work, self._event, self._after, self._deadline = work, event, after, deadline
        self._waited = False
        self._entry = entry  # this call on the status board (numbered when issued)
        if work is None:  # ran synchronously (hand-written implementations)
            event["end"] = recorder.mark()
        elif recorder._on_gpu():
            side = _marker_stream()  # marks the end on the device without blocking the host
            with torch.cuda.stream(side):
                work.wait()
            event["end"] = recorder.mark(side)
        else:  # gloo completes on its own thread; note the moment it does
            try:
                work.get_future().then(
                    lambda _: event.__setitem__(
                        "end",
                        recorder.mark() if deadline is None else _emulation.emulated_end(recorder.mark(), deadline),
                    )
                )
            except RuntimeError:  # some gloo ops (reduce-scatter) have no future: the end is marked at
                pass  # wait(), an upper bound on when it finished

    def wait(self):
        if not self._waited:
            self._waited = True
            tell("wait", self._event)
        if self._work is not None:
            status.resume(self._entry)
            # time spent blocked here is idle compute: the trace shows it as a "wait" span
            blocked = (
                None
                if self._work.is_completed()
                else recorder.add("wait", "wait", recorder.mark(), op=self._event["name"])
            )
            try:
                self._work.wait()
            except BaseException as exc:
                status.fail(self._entry)
                if isinstance(exc, RuntimeError):
                    raise explained(exc, self._entry) from exc
                raise
            status.end(self._entry)
            if blocked is not None:
                blocked["end"] = recorder.mark()
            if self._event["end"] is None:
                self._event["end"] = recorder.mark()
        if self._deadline is not None:  # the emulated link: not before the model says so
            _emulation.hold(self._event, self._deadline)
            self._deadline = None
        if self._after is not None:
            self._after()
            self._after = None
        return None

    def is_completed(self) -> bool:
        done = self._work is None or self._work.is_completed()
        if done and self._deadline is not None and time.perf_counter() < _emulation.when(self._deadline):
            return False
        return done

    @property
    def event(self) -> dict:
        """This call's trace record; callers may annotate its args (an MoE layer names its chunks)."""
        return self._event


class PeerFailed(Consequence, RuntimeError):
    """A collective failed on this rank because another rank of its group went away or never came."""


def explained(exc: Exception, entry: status.Entry) -> RuntimeError:
    """Say which call failed, and whether this rank is its cause or a casualty of another rank."""
    text = str(exc)
    where = f"{entry.describe()} failed on rank {dist.get_rank()}"
    if "timed out" in text.lower() or "timeout" in text.lower():
        return PeerFailed(
            f"{where}: it timed out waiting for the other ranks of the group.\n"
            f"{type(exc).__name__}: {text}\nA collective completes only when every rank of its group "
            "calls it, with matching shapes: look for a rank that raised or died first, skipped "
            "this call, called another one, or is still computing."
        )
    if is_consequence(exc):
        return PeerFailed(
            f"{where}: another rank of the group went away (it raised, died or was stopped); "
            f"look for that rank's own error.\n{type(exc).__name__}: {text}"
        )
    return RuntimeError(f"{where}.\n{type(exc).__name__}: {text}")
