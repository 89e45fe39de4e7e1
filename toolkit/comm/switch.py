"""The switch: which implementation runs each collective, the backend's or a hand-written one.

The door (`collectives.py`) records every call the same way, then runs whatever this switch selects:
the backend's collectives (NCCL or gloo, `backend.py`), the hand-written ones the lessons build on
send/recv (`use("ring")`: the ring of `ring.py`, the pairwise all-to-all of `alltoall.py`), or a
student's functions for some operations (a lab's solution plugged in). Each has the backend's
signature, so training code never knows which runs; the trace does (`args.impl`).
"""

from __future__ import annotations

from . import backend as _backend

OPERATIONS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")

_impl: dict = dict(_backend.IMPLEMENTATION)
_impl_name = "backend"


def use(implementation="backend") -> str:
    """Route the toolkit's collectives: "backend", "ring", or a dict {operation: function}.

    A dict replaces only the operations it names (a student's ring all-reduce, say); each function
    has the backend's signature (see `toolkit.comm.backend`). Returns the previous choice's name.
    """
    global _impl, _impl_name
    from . import alltoall, ring  # noqa: F401 - hand-written implementations register themselves

    previous = _impl_name
    if implementation == "backend":
        _impl, _impl_name = dict(_backend.IMPLEMENTATION), "backend"
    elif implementation == "ring":
        _impl = dict(_backend.IMPLEMENTATION, **ring.IMPLEMENTATION, **alltoall.IMPLEMENTATION)
        _impl_name = "ring"
    elif isinstance(implementation, dict):
        unknown = set(implementation) - set(OPERATIONS)
        if unknown:
            raise ValueError(f"use() got unknown operations {sorted(unknown)}; valid: {OPERATIONS}.")
        _impl = dict(_backend.IMPLEMENTATION, **implementation)
        _impl_name = "custom"
    else:
        raise ValueError(f"use({implementation!r}): choose 'backend', 'ring' or a dict {{operation: function}}.")
    return previous


def implementation() -> str:
    return _impl_name


class using:
    """`with comm.using("ring"): ...` switches the implementation for a block, then switches back."""

    def __init__(self, implementation):
        self.implementation = implementation

    def __enter__(self):
        self._previous = dict(_impl), _impl_name
        use(self.implementation)

    def __exit__(self, *exc):
        global _impl, _impl_name
        _impl, _impl_name = self._previous


def function(operation: str):
    """The function that runs `operation` now."""
    return _impl[operation]


def is_backend(operation: str) -> bool:
    """Whether `operation` runs the backend's own collective (only those can run asynchronously);
    true of the operations no implementation replaces (send, recv, barrier)."""
    return _impl.get(operation) is _backend.IMPLEMENTATION.get(operation)
