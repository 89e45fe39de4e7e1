"""Who hears about the toolkit's collectives: a timeline recorder (toolkit.sim) listens to every call's issue
and wait, in the order they happen."""

from __future__ import annotations

_listeners: list = []  # fn(kind, event, tensor): see `listening`


class listening:
    """`with comm.listening(fn): ...` calls `fn(kind, event, tensor)` at every collective inside the block.

    kind is "issue" right after a call has started (`event` is its trace record, `tensor` the message
    the door sized it by) and "wait" (tensor None) when this rank blocks until it is complete: a
    synchronous call is an "issue" then a "wait" at once; an asynchronous one waits where its
    `Handle.wait()` is called. That order is what a timeline needs (toolkit.sim records a step's program
    from it); a collective's own timing, as the backend reports it, stays in `event`.
    """

    def __init__(self, fn):
        self.fn = fn

    def __enter__(self):
        _listeners.append(self.fn)
        return self

    def __exit__(self, *exc):
        _listeners.remove(self.fn)


def tell(kind: str, event: dict, tensor=None) -> None:
    for fn in _listeners:
        fn(kind, event, tensor)
