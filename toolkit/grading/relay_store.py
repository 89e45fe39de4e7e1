"""The store a rank's relay-carried process groups are made with (`relay_group.switch`): the rank's own, in which
every rendezvous is already met. Its groups need none (the relay holds a message, or a member's call of a
collective, until its peers come), and a store shared with the other ranks would be a channel the relay does not
see. One kind of key is shared, through the relay: the emulated link's bookings (`comm/store_ledger.py`: when each
link is busy, when an all-to-all's chunks reach a receiver), which the ranks of one job must see alike for
`toolkit.comm.emulate` to time them as it does on a real store. The relay keeps them (`Bookings`) and takes only
those: a key of the ledger's, a value that is times (a link's calendar, or a note), within a budget of bytes.
"""

from __future__ import annotations

import re

import torch.distributed as dist

LEDGER = "toolkit/emulated_link/"  # comm/store_ledger.PREFIX: the keys the relay keeps for every rank
TIME = rb"-?[0-9.]+(e[-+]?[0-9]+)?"
VALUE = re.compile(rb"^(" + TIME + rb"( " + TIME + rb")*( [0-9]+\.[0-9]+)?)?$")  # "<seconds>... <pid>.<count>" or ""
MAX_VALUE = 4096  # bytes of one value: a calendar of about a hundred intervals
MAX_BOOKINGS = 100_000  # keys the relay keeps for one launch
MAX_BYTES = 16 << 20  # and the bytes of their values, together


class Agreeing(dist.Store):
    """The rank's own store, in which every rendezvous is already met: its groups need none (the relay holds a
    message until its receiver asks for it), and a store shared with the other ranks would carry what the relay
    does not see."""

    def __init__(self, link=None):
        super().__init__()
        self.values: dict[str, bytes] = {}
        self.link = link  # to the relay, which keeps the bookings

    def _booked(self, do: str, key: str, expected=b"", value=b"") -> bytes | None:
        if self.link is None or LEDGER not in key:
            return None
        message = {"op": "booking", "do": do, "key": key, "expected": _text(expected), "value": _text(value)}
        work = self.link.request(message)
        work.wait()
        return work.payload

    def set(self, key, value):
        if self._booked("set", key, value=value) is None:
            self.values[key] = value if isinstance(value, bytes) else str(value).encode()

    def get(self, key):
        booked = self._booked("get", key)
        return self.values.get(key, b"1") if booked is None else booked

    def add(self, key, amount):
        return 1 << 30  # as many as any rendezvous waits for

    def compare_set(self, key, expected, desired):
        booked = self._booked("compare_set", key, expected, desired)
        return _compare_set(self.values, key, expected, desired) if booked is None else booked

    def check(self, keys):
        return True

    def wait(self, keys, timeout=None):
        return None

    def delete_key(self, key):
        return self.values.pop(key, None) is not None

    def num_keys(self):
        return len(self.values)


def _text(value) -> str:
    return (value if isinstance(value, bytes) else str(value).encode()).decode(errors="replace")


def _compare_set(values: dict, key: str, expected, desired) -> bytes:
    """c10d's compare-and-set: `desired` where the key holds `expected` (or is missing and `expected` is empty);
    the value it holds after."""
    expected = expected if isinstance(expected, bytes) else str(expected).encode()
    desired = desired if isinstance(desired, bytes) else str(desired).encode()
    current = values.get(key)
    if current == expected or (current is None and not expected):
        values[key] = desired
    return values.get(key, expected)


class Bookings:
    """The grader's side: the emulated link's bookings of one launch, kept for every rank (see the module doc).
    Anything but a ledger key with times for its value is refused."""

    def __init__(self):
        self.values: dict[str, bytes] = {}
        self.bytes = 0  # of the values kept

    def handle(self, message: dict) -> bytes:
        do, key = message.get("do"), message.get("key")
        expected, value = (str(message.get(k, "")).encode() for k in ("expected", "value"))
        if not (isinstance(key, str) and len(key) <= 256 and LEDGER in key and do in ("set", "get", "compare_set")):
            raise ValueError("a booking of the emulated link that is not one")
        if not all(len(v) <= MAX_VALUE and VALUE.match(v) for v in (expected, value)):
            raise ValueError("a booking of the emulated link whose value is not times")
        if key not in self.values and len(self.values) >= MAX_BOOKINGS:
            raise ValueError(f"more than {MAX_BOOKINGS} bookings of the emulated link in a launch")
        if self.bytes - len(self.values.get(key, b"")) + len(value) > MAX_BYTES:
            raise ValueError(f"more than {MAX_BYTES >> 20} MiB of bookings of the emulated link in a launch")
        if do == "get":
            return self.values.get(key, b"0")  # a note from the past: no receiver waits for it
        before = len(self.values.get(key, b""))
        if do == "set":
            self.values[key], found = value, b""
        else:
            found = _compare_set(self.values, key, expected, value)
        self.bytes += len(self.values.get(key, b"")) - before
        return found
