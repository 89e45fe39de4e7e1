"""Where the emulated link's shared bookings live: the job's key-value store, seen by every rank.

A rank's own link is booked in its own process (``cost.Ledger``). What other ranks book too lives in
the process group's store: a node's card when several ranks share it, and, for an all-to-all, every
receiver's receiving side, on which its senders queue their chunks (backpressure, ``cost.py``). A
reservation is an atomic compare-and-set of the resource's calendar (its busy intervals, ``cost.first_fit``)
on one clock (perf_counter is the machine's monotonic clock, the same in every process); a note (when an
all-to-all's chunks into a receiver are delivered) is a compare-and-set of the latest end, read and deleted
by the receiver once the data has moved; a mark (when a rank issued a ring collective, ``comm/deadlines.py``) is set
by that rank alone and read by its peers. Same methods as ``cost.Ledger``, which stands in when no process group is
up.
"""

from __future__ import annotations

import os

from .cost import FORGET_S, Ledger, first_fit

PREFIX = "toolkit/emulated_link/"
_shared: dict = {}
_count = [0]  # this process's writes: with its pid, the mark that makes each written value unique
_seen: dict = {}  # a link's key -> the calendar this process last wrote there: its next swap's first guess


class StoreLedger:
    """``reserve``, ``note`` and ``take`` on the job's store (see the module doc)."""

    def __init__(self, store):
        self.store = store

    @staticmethod
    def _key(parts) -> str:
        return PREFIX + "/".join(str(part) for part in _flat(parts))

    def _swap(self, key: str, change, guess: bytes = b""):
        """Replace ``key``'s numbers atomically: change(numbers now, [] when new) -> (result, numbers to store);
        returns the result. The first compare-and-set starts from ``guess`` (what this process last saw there), so
        an uncontended swap is one round trip; one that failed returns the value found, and the next starts from
        it. A value carries this writer's mark, so a failure never reads as a success with the same numbers."""
        current = guess
        while True:
            _count[0] += 1
            result, numbers = change([float(x) for x in current.split()[:-1]] if current else [])
            wanted = " ".join([repr(x) for x in numbers] + [f"{os.getpid()}.{_count[0]}"]).encode()
            found = self.store.compare_set(key, current, wanted)
            if found == wanted:
                return result, wanted
            # a key that is not there answers with the value guessed (c10d's compare_set): start from nothing
            current = b"" if found == current else found

    def reserve(self, resource, earliest: float, seconds: float, issued: float | None = None) -> float:
        forget = (earliest if issued is None else issued) - FORGET_S

        def book(numbers):
            end, busy = first_fit(list(zip(numbers[::2], numbers[1::2])), earliest, seconds, forget)
            return end, [x for interval in busy for x in interval]

        key = self._key(resource)
        end, _seen[key] = self._swap(key, book, _seen.get(key, b""))
        return end

    def note(self, key, end: float) -> None:
        self._swap(self._key(key), lambda latest: (None, [max([end] + latest)]))  # a new key each call: guess none

    def take(self, key) -> float:
        name = self._key(key)
        end = float(self.store.get(name).split()[0])  # its senders noted it before the data moved: it is there
        try:
            self.store.delete_key(name)
        except RuntimeError:  # a store written in Python cannot delete (torch 2.13): the grader's relay's ranks'
            self.store.set(name, "0")  # a note from the past, which no later one is earlier than
        return end

    def mark(self, key, numbers) -> None:
        """Set ``key`` to ``numbers`` (one writer: a rank's own issue mark, ``deadlines.issue_mark``)."""
        self.store.set(self._key(key), " ".join(repr(x) for x in numbers))

    def marks(self, keys) -> list:
        """The (call, time) pairs marked under ``keys``, never waiting for one: a peer marks its call before making it,
        so after a real collective every mark is there; a call that did not meet its peers (an implementation that
        never talked to them) reads the missing ones as (-1, 0) rather than wait for them."""
        names = [self._key(key) for key in keys]
        if not self.store.check(names):
            return [_pair(self.store.get(name)) if self.store.check([name]) else (-1, 0.0) for name in names]
        try:
            values = self.store.multi_get(names)
        except (AttributeError, NotImplementedError, RuntimeError):  # a store written in Python (the grader's relay)
            values = [self.store.get(name) for name in names]
        return [_pair(value) for value in values]


def _pair(value: bytes) -> tuple:
    """(call, time) from a mark's value; (-1, 0) for anything else (a relay's answer for a key it never had)."""
    parts = value.split()
    return (int(float(parts[0])), float(parts[1])) if len(parts) == 2 else (-1, 0.0)


def _flat(parts):
    for part in parts:
        if isinstance(part, (tuple, list)):
            yield from _flat(part)
        else:
            yield part


def shared_ledger():
    """The job's store ledger (one per store), or a process-local Ledger without a process group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return _shared.setdefault("local", Ledger())
    store = dist.distributed_c10d._get_default_store()
    if _shared.get("store") is not store:
        _shared.update(store=store, ledger=StoreLedger(store))
    return _shared["ledger"]
