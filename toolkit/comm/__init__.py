"""How ranks talk: every collective goes through `toolkit.comm` so that traces are complete."""

from .collectives import (
    Handle,
    all_gather,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    group_ranks,
    irecv,
    isend,
    recv,
    reduce_scatter,
    send,
)
from .emulate import Link, emulate, emulated_link, emulation_description
from .listeners import listening
from .switch import OPERATIONS, implementation, use, using

__all__ = [
    "OPERATIONS",
    "Handle",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "group_ranks",
    "implementation",
    "irecv",
    "isend",
    "listening",
    "recv",
    "reduce_scatter",
    "send",
    "use",
    "using",
    "Link",
    "emulate",
    "emulated_link",
    "emulation_description",
]
