"""A Ctrl-C lands where a launch can unwind from it: never between starting a process and holding what stops it.

Python raises KeyboardInterrupt in the main thread at whatever line it has reached when SIGINT arrives (Ctrl-C in a
terminal; a notebook's stop button, which makes Jupyter send the kernel SIGINT). Between asking for the keeper (which
starts the ranks at once) and holding the handle that a `finally` stops it by, or while that `finally` runs, an
interrupt would leave the keeper and its ranks running with nobody to stop them. So a launch runs `held()`: SIGINT is
noted, not acted on, and the handler the launcher had (KeyboardInterrupt, normally) runs once the launch has stopped
everything; `taken()` lets it act at once where the launch only waits (for its ranks, for a zygote to import torch).
What is held is short: milliseconds to start a keeper, and stopping one (well under a second; 15 s at most).

Why a stand-in handler rather than blocking SIGINT (`pthread_sigmask`): a mask is per thread, and the kernel hands a
process's SIGINT to any thread not blocking it (a notebook kernel has several, the rendezvous store one more), whose
C handler then has the main thread raise all the same; and what the launcher starts would inherit the mask.

Only the main thread runs Python's signal handlers and may change them: elsewhere both do nothing (no
KeyboardInterrupt lands there). Where SIGINT is ignored or left to the system (it then kills the launcher, and the
keeper dies with it: `keeper.py`), nothing changes either.
"""

from __future__ import annotations

import signal
import threading

_handler = None  # the launcher's own SIGINT handler, while `_note` stands in for it
_taking: list[bool] = []  # per open `held` (False) or `taken` (True) stretch, innermost last
_noted = None  # the frame a held SIGINT arrived in (None: none is waiting)

# Each step below leaves a state a SIGINT may land in: `_note` is installed before the first stretch is pushed and
# removed after the last is popped (while none is open, it notes), and what was noted is taken before it is acted on.
# Once a Ctrl-C acts in a `taken` stretch, the rest of it unwinds held; and each stretch's exit drops every stretch
# opened inside it, since the interrupt can land just before an inner stretch's `__exit__` runs (it then never does).


def _acted() -> None:
    if _taking:
        _taking[-1] = False


def _note(signum, frame) -> None:
    global _noted
    if _taking and _taking[-1]:
        _acted()
        _handler(signum, frame)
    else:
        _noted = frame


def _deliver() -> None:
    """Run the launcher's handler for a SIGINT noted meanwhile (raising KeyboardInterrupt here, normally)."""
    global _noted
    frame, _noted = _noted, None
    if frame is not None:
        _acted()
        _handler(signal.SIGINT, frame)


class _Stretch:
    taking = False

    def __enter__(self):
        global _handler, _noted
        self.open = threading.current_thread() is threading.main_thread() and (
            bool(_taking) or (not self.taking and callable(signal.getsignal(signal.SIGINT)))
        )
        if not self.open:
            return self
        depth = self.depth = len(_taking)
        try:
            if not depth:
                _handler, _noted = signal.getsignal(signal.SIGINT), None
                signal.signal(signal.SIGINT, _note)
            _taking.append(self.taking)
            if self.taking:
                _deliver()
        except BaseException:
            del _taking[depth:]  # it raised on entry (a Ctrl-C that was waiting): `__exit__` is not called
            raise
        return self

    def __exit__(self, kind, value, traceback):
        global _noted
        if not self.open:
            return
        del _taking[self.depth :]
        if kind is not None and issubclass(kind, KeyboardInterrupt):
            _noted = None  # a second Ctrl-C while the first one unwinds: the same interrupt
        if not _taking:
            signal.signal(signal.SIGINT, _handler)
        if not _taking or _taking[-1]:
            _deliver()


class held(_Stretch):
    """SIGINT is noted, not acted on, until this stretch ends (then the launcher's handler runs, if it came)."""


class taken(_Stretch):
    """Inside a `held` stretch: SIGINT acts at once (one that came before acts on entry). Outside one: nothing."""

    taking = True
