"""When an emulated call may finish where that depends on its peers: read once its data has moved.

A call's own deadline is counted from the moment this rank issued it (``emulate.book``). A real link cannot start a
collective before every rank of its group has called it, so where a peer comes late the call ends that much later
for everyone, not only for the late rank. An all-to-all learns it from what it receives (``Arrival``: its senders
noted when their chunks reach it). A ring collective or a barrier learns it from its peers' issue times
(``Together``): each rank marks its own in the job's store before its real call, and every rank reads them once the
real call has completed, by which time every peer has called it, so the marks are there and nothing waits for them.
"""

from __future__ import annotations

from .cost import all_to_all_finish

SLOTS = 64  # a group's issue marks are kept in this many slots per rank, reused in turn


class Arrival:
    """An all-to-all's deadline: when this rank's chunks are delivered and the chunks it receives have
    arrived (their senders noted when, before the data moved), plus the messages' latencies. Read with
    ``when`` once the real all-to-all is complete."""

    def __init__(self, shared, delivered, messages, kinds, call, me, issued, alone):
        self.shared, self.delivered, self.messages, self.kinds = shared, delivered, messages, kinds
        self.call, self.me, self.issued, self.alone, self._at = call, me, issued, alone, None

    def at(self) -> float:
        if self._at is None:
            self._at = all_to_all_finish(self.shared, self.delivered, self.messages, self.kinds, self.call, self.me)
        return self._at

    def explain(self, args: dict) -> None:
        args["emulated_queue_s"] = max(0.0, self.at() - self.issued - self.alone)  # known only now


def issue_mark(shared, group: str, call: int, me: int, issued: float) -> None:
    """Mark in the job's store that rank ``me`` issued call number ``call`` of ``group`` at ``issued``."""
    shared.mark(("issue", group, call % SLOTS, me), [call, issued])


class Together:
    """A ring collective's (or a barrier's) deadline: this rank's own, or the group's last issue plus the call's time
    on idle links, whichever is later. A peer's mark of a later call in the same slot (it ran ``SLOTS`` calls ahead)
    says it issued this one earlier still, so it is not the late one."""

    def __init__(self, own: float, shared, group: str, call: int, peers, issued: float, alone: float):
        self.own, self.shared, self.group, self.call, self.peers = own, shared, group, call, list(peers)
        self.issued, self.alone, self._at = issued, alone, None

    def at(self) -> float:
        if self._at is None:
            marks = self.shared.marks([("issue", self.group, self.call % SLOTS, p) for p in self.peers])
            last = max([self.issued] + [t for call, t in marks if call == self.call])
            self._at = max(self.own, last + self.alone)
        return self._at

    def explain(self, args: dict) -> None:
        args["emulated_peers_s"] = max(0.0, self.at() - self.own)  # how long it waited for a late peer


def when(deadline) -> float:
    """A deadline in perf_counter seconds (one that depends on the peers read: call once the data moved)."""
    return deadline if isinstance(deadline, (int, float)) else deadline.at()
