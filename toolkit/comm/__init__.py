"""How ranks talk: every collective goes through `toolkit.comm` so that traces are complete."""
from .collectives import (OPERATIONS, Handle, all_gather, all_reduce, all_to_all, barrier, broadcast,
                          group_ranks, implementation, irecv, isend, recv, reduce_scatter, send, use, using)

__all__ = ["OPERATIONS", "Handle", "all_gather", "all_reduce", "all_to_all", "barrier", "broadcast",
           "group_ranks", "implementation", "irecv", "isend", "recv", "reduce_scatter", "send", "use", "using"]
