"""A tiny shared-memory notice board: which collective each rank is in, and how far each rank got.

The launcher reads it to tell a student *which* rank failed to enter *which* collective, even when that
rank cannot speak any more. Writing costs a few memory stores (no system call), so the collectives door
can post on every call.

Numbering: each collective a rank enters is numbered within its group. `all_reduce #7 (group [0, 1, 2])`
is the 7th collective this rank entered on the group of ranks 0, 1 and 2 (of any kind). In a correct
program every member numbers the same call alike, so a member whose count on that group is below 7 never
entered it. Point-to-point calls are numbered on their pair of ranks. Two process groups over the same
ranks share one count (the board knows groups by their ranks).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
from typing import NamedTuple

IDLE, INSIDE, FAILED = 0, 1, 2
_SEQ = struct.Struct("<Q")  # odd while the rank is writing its slot (a seqlock: see `read`)
_HEAD = struct.Struct("<Bdqq")  # state, since (time.time() of entering), number, group key
_SLOT = struct.Struct("<qq")  # (group key, collectives entered on it)
_SLOTS = 32
_HEAD_AT = _SEQ.size
_SLOTS_AT = _HEAD_AT + _HEAD.size
_TEXT_AT = _SLOTS_AT + _SLOTS * _SLOT.size
_SIZE = 2048
_DEAD_WRITER_S = 1.0  # a slot odd for this long belongs to a rank that died writing it


class Entry(NamedTuple):
    """One collective as a rank entered it: `op #number (group [ranks])`, and what it carried."""

    op: str
    group: tuple  # global ranks taking part; () for free text (a grader's check)
    number: int
    detail: str = ""

    def label(self) -> str:
        if not self.group:
            return self.op
        return f"{self.op} #{self.number} ({'ranks' if self.op in ('send', 'recv') else 'group'} {list(self.group)})"

    def describe(self) -> str:
        return self.label() + (f" ({self.detail})" if self.detail else "")


class Snapshot(NamedTuple):
    """What the launcher reads from one rank's slot."""

    state: int
    since: float
    entry: Entry | None
    counts: dict  # group key -> collectives entered on it

    def entered(self, group: tuple) -> int:
        return self.counts.get(key(group), 0)


def key(group: tuple) -> int:
    """The same number for the same ranks in every process (hashing a tuple of ints is not salted)."""
    return hash(tuple(group)) or 1


class StatusBoard:
    """One rank's slot, memory-mapped from a file the launcher also maps."""

    def __init__(self, path: str, create: bool = False):
        if create:
            with open(path, "wb") as f:
                f.write(b"\0" * _SIZE)
        self._file = open(path, "r+b")
        self._map = mmap.mmap(self._file.fileno(), _SIZE)
        self._slots: dict[int, int] = {}
        self._posted: Entry | None = None
        self._seq = _SEQ.unpack_from(self._map, 0)[0]

    @contextlib.contextmanager
    def _writing(self):
        """Mark the slot as being written (sequence odd), then as written (even again)."""
        self._seq += 1
        _SEQ.pack_into(self._map, 0, self._seq)
        try:
            yield
        finally:
            self._seq += 1
            _SEQ.pack_into(self._map, 0, self._seq)

    def post(self, state: int, entry: Entry | None, since: float = 0.0) -> None:
        with self._writing():
            if entry is not None and entry is not self._posted:  # the text only changes with the entry
                self._posted = entry
                text = "\x1f".join((entry.op, ",".join(map(str, entry.group)), entry.detail)).encode()
                text = text[: _SIZE - _TEXT_AT - 1]
                self._map[_TEXT_AT : _TEXT_AT + len(text) + 1] = text + b"\0"
            number, group = (entry.number, key(entry.group)) if entry is not None and entry.group else (0, 0)
            _HEAD.pack_into(self._map, _HEAD_AT, state, since, number, group)

    def count(self, group_key: int, entered: int) -> None:
        slot = self._slots.setdefault(group_key, len(self._slots))
        if slot < _SLOTS:  # beyond that many groups a rank's counts are not shown (never seen in practice)
            with self._writing():
                _SLOT.pack_into(self._map, _SLOTS_AT + slot * _SLOT.size, group_key, entered)

    def read(self) -> Snapshot:
        """A consistent copy of the slot. The rank writes field by field and can be descheduled half-way (a
        loaded machine): a copy is kept only if the sequence was even before it and unchanged after it, so
        no reader ever sees a new state with an old time. A rank that died mid-write leaves it odd: after
        `_DEAD_WRITER_S` the copy is taken as it is (its process has ended, which the launcher sees)."""
        give_up = time.monotonic() + _DEAD_WRITER_S
        while True:
            first = bytes(self._map)
            seq = _SEQ.unpack_from(first, 0)[0]
            if (seq % 2 == 0 and _SEQ.unpack_from(self._map, 0)[0] == seq) or time.monotonic() > give_up:
                break
            time.sleep(0.0005)
        state, since, number, _ = _HEAD.unpack_from(first, _HEAD_AT)
        counts = dict(_SLOT.unpack_from(first, _SLOTS_AT + i * _SLOT.size) for i in range(_SLOTS))
        counts.pop(0, None)
        text = first[_TEXT_AT:].split(b"\0", 1)[0].decode(errors="replace")
        entry = None
        if text:
            op, group, detail = (text.split("\x1f") + ["", ""])[:3]
            entry = Entry(op, tuple(int(r) for r in group.split(",") if r), number, detail)
        return Snapshot(state, since, entry, counts)

    def close(self) -> None:
        self._map.close()
        self._file.close()


# --- this process's side: numbering, and the board if a launcher gave us one --------------------------
_board: StatusBoard | None = None
_entered: dict[int, int] = {}
_current: Entry | None = None
_before_next = None


def attach(path: str) -> None:
    """Called in a launched rank: from now on the door posts here."""
    global _board
    _board = StatusBoard(path)


def before_next_collective(fn) -> None:
    """Run `fn()` once, just before the next collective this process enters (None: forget it)."""
    global _before_next
    _before_next = fn


def begin(op: str, group, detail: str = "") -> Entry:
    """Enter a collective: number it on its group, post "inside since now"."""
    global _before_next
    if _before_next is not None:
        fn, _before_next = _before_next, None
        fn()
    group = tuple(group)
    k = key(group)
    number = _entered[k] = _entered.get(k, 0) + 1
    entry = Entry(op, group, number, detail)
    if _board is not None:
        _board.count(k, number)
    resume(entry)
    return entry


def resume(entry: Entry) -> None:
    """Back inside a collective already entered (waiting on an asynchronous one)."""
    global _current
    _current = entry
    if _board is not None:
        _board.post(INSIDE, entry, time.time())


def end(entry: Entry) -> None:
    """Out of the collective (finished, or issued asynchronously and not waited on yet)."""
    global _current
    _current = None
    if _board is not None:
        _board.post(IDLE, entry)


def fail(entry: Entry) -> None:
    """The collective raised on this rank: the board keeps it, marked failed."""
    global _current
    _current = None
    if _board is not None:
        _board.post(FAILED, entry, time.time())


def busy() -> bool:
    """True while this process is inside something already posted (nested calls are not posted again)."""
    return _current is not None


def entered(group) -> int:
    """Collectives this process entered on the group of these ranks."""
    return _entered.get(key(tuple(group)), 0)


def reset() -> None:
    """Forget the numbering (a process group was re-created: every rank starts again from #1)."""
    _entered.clear()


def enter(what: str) -> None:
    """Post free text ("check 'ring'"): the launcher reports a rank stuck in it for too long."""
    resume(Entry(what, (), 0))


def leave() -> None:
    if _current is not None:
        end(_current)


def board_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"status-{rank}")
