"""The store a rank's relay-carried process groups are made with (`relay_group.switch`): the rank's own, shared with
no one, in which every rendezvous is already met. Its groups need none (the relay holds a message, or a member's
call of a collective, until its peers come), and a store shared with the other ranks would be a channel the relay
does not see. Keys the rank itself writes (the emulated link's bookings, `comm/store_ledger.py`) read back as
written.
"""

from __future__ import annotations

import torch.distributed as dist


class Agreeing(dist.Store):
    """The rank's own store, in which every rendezvous is already met: its groups need none (the relay holds a
    message until its receiver asks for it), and a store shared with the other ranks would carry what the relay
    does not see."""

    def __init__(self):
        super().__init__()
        self.values: dict[str, bytes] = {}

    def set(self, key, value):
        self.values[key] = value if isinstance(value, bytes) else str(value).encode()

    def get(self, key):
        return self.values.get(key, b"1")

    def add(self, key, amount):
        return 1 << 30  # as many as any rendezvous waits for

    def compare_set(self, key, expected, desired):
        current = self.values.get(key)
        expected = expected if isinstance(expected, bytes) else str(expected).encode()
        if current == expected or (current is None and not expected):
            self.set(key, desired)
        return self.values.get(key, expected)

    def check(self, keys):
        return True

    def wait(self, keys, timeout=None):
        return None

    def delete_key(self, key):
        return self.values.pop(key, None) is not None

    def num_keys(self):
        return len(self.values)
