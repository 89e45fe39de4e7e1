"""How ranks talk: every collective goes through `toolkit.comm` so that traces are complete."""

from .collectives import (
    OPERATIONS,
    Handle,
    all_gather,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    group_ranks,
    implementation,
    irecv,
    isend,
    recv,
    reduce_scatter,
    send,
    use,
    using,
)
from .emulate import Link, emulate, emulated_link, emulation_description
from .listeners import listening

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
