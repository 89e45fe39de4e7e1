"""A tiny shared-memory notice board: which collective each rank is inside, and since when.

The launcher reads it to tell a student *which* rank hung in *which* collective, even when that rank
cannot speak any more. Writing costs a memory store (no system call), so the collectives door can
post on every call.
"""
from __future__ import annotations

import mmap
import os
import struct
import time

_FORMAT = "dq"  # start time (time.time(), 0.0 when idle), number of collectives completed
_HEADER = struct.calcsize(_FORMAT)
_SIZE = 512


class StatusBoard:
    """One rank's slot, memory-mapped from a file the launcher also maps."""

    def __init__(self, path: str, create: bool = False):
        if create:
            with open(path, "wb") as f:
                f.write(b"\0" * _SIZE)
        self._file = open(path, "r+b")
        self._map = mmap.mmap(self._file.fileno(), _SIZE)
        self._done = 0

    def enter(self, what: str) -> None:
        data = what.encode()[: _SIZE - _HEADER - 1]
        self._map[_HEADER : _HEADER + len(data) + 1] = data + b"\0"
        struct.pack_into(_FORMAT, self._map, 0, time.time(), self._done)

    def leave(self) -> None:
        self._done += 1
        struct.pack_into(_FORMAT, self._map, 0, 0.0, self._done)

    def read(self) -> tuple[float, int, str]:
        """(seconds inside the current collective or 0.0, collectives done, last collective entered)."""
        since, done = struct.unpack_from(_FORMAT, self._map, 0)
        text = bytes(self._map[_HEADER:_SIZE]).split(b"\0", 1)[0].decode(errors="replace")
        return (time.time() - since if since else 0.0), done, text

    def describe(self) -> str:
        waited, done, what = self.read()
        if waited:
            return f"inside {what} for {waited:.1f}s ({done} collectives completed before it)"
        last = f"; last was {what}" if what else ""
        return f"not in a collective ({done} completed{last})"

    def close(self) -> None:
        self._map.close()
        self._file.close()


_board: StatusBoard | None = None


def attach(path: str) -> None:
    """Called in a launched rank: from now on the door posts here."""
    global _board
    _board = StatusBoard(path)


def enter(what: str) -> None:
    if _board is not None:
        _board.enter(what)


def leave() -> None:
    if _board is not None:
        _board.leave()


def board_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"status-{rank}")
