"""The grader's relay, for a lab whose ranks may talk only in point-to-point messages (checks.py: `MESSAGES_ONLY =
True`): it carries every message between the submission's ranks, keeps the record the traffic checks read, and
hands each check its inputs and takes its results.

The ranks of such a lab have no process group of their own (`relay_group.py`): each holds one connection to this
relay, a UNIX socket in the grading's folder, opened with a token only it was sent. A send is held until its
receiver posts the matching receive (same group, tag, source and destination), then delivered; the sender's
work completes then, as gloo's does. What the relay records is what it carried, not what a rank says it sent:
for every rank, each send and receive it posted (kind, peer, elements), with the check it belongs to. A check
belongs to the span between the rank taking the check's inputs (`{"op": "inputs"}`: the relay gives them only
once the rank has handed in the previous check's result) and handing in its result (`{"op": "result"}`: the
first one counts). So every message a result could depend on is in its check's record: a submission cannot
fetch the inputs early, exchange them in another check's span, and leave ring-shaped decoys where the check
looks. The grader substitutes this record for what the rank reports under `messages` (`grader._verdict`).

It runs in the grader's process, in threads: one accepting, one per rank. Everything a rank sends it is read as
untrusted frames (capped, checked), never code.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from collections import defaultdict, deque

from .relay_group import read_frame, send_frame

MAX_MESSAGE = 64 * 2**20  # one message's bytes (a result's too: wire.MAX_BYTES)
MAX_HELD = 256 * 2**20  # bytes of sends held for their receivers, all ranks together


class Relay:
    """`with Relay(folder, n, inputs) as relay:` for one launch; `relay.path`, `relay.tokens[r]` go to the ranks.
    inputs[index][rank]: the wire-encoded inputs of each check (in the order the ranks take them)."""

    def __init__(self, folder: str, world_size: int, order: list, inputs: dict):
        self.world_size, self.order, self.inputs = world_size, [str(i) for i in order], inputs
        self.tokens = [secrets.token_hex(16) for _ in range(world_size)]
        self.path = os.path.join(folder, "relay.sock")
        self.results: dict[str, dict[int, bytes]] = defaultdict(dict)
        self.record: dict[int, dict[str, list]] = {r: defaultdict(list) for r in range(world_size)}
        self._at = [0] * world_size  # the position in `order` of the check each rank is in (0: importing)
        self._lock = threading.Lock()
        self._held = 0
        self._sends, self._recvs = defaultdict(deque), defaultdict(deque)  # (src, dst, group, tag) -> posts
        self._ranks: dict[int, socket.socket] = {}
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if os.path.lexists(self.path):  # the last launch's
            os.unlink(self.path)
        self._server.bind(self.path)
        os.chmod(self.path, 0o666)  # the ranks may run as another user; the token says who is who
        self._server.listen(world_size)
        self._threads = [threading.Thread(target=self._accept, daemon=True, name="grading-relay")]
        self._threads[0].start()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for sock in [self._server, *self._ranks.values()]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        for thread in self._threads:
            thread.join(timeout=5)
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return
            sock.settimeout(30)
            try:
                frame = read_frame(sock, 0)
            except (OSError, ValueError):
                frame = None
            hello = frame[0] if frame else {}
            rank = hello.get("rank")
            if not (
                isinstance(rank, int)
                and 0 <= rank < self.world_size
                and rank not in self._ranks
                and secrets.compare_digest(str(hello.get("token")), self.tokens[rank])
            ):
                sock.close()
                continue
            sock.settimeout(None)
            self._ranks[rank] = sock
            thread = threading.Thread(target=self._serve, args=(rank, sock), daemon=True, name=f"grading-relay-{rank}")
            self._threads.append(thread)
            thread.start()

    def _serve(self, rank: int, sock: socket.socket) -> None:
        while True:
            try:
                frame = read_frame(sock, MAX_MESSAGE)
            except (OSError, ValueError):
                return
            if frame is None:
                return
            message, payload = frame
            try:
                self._handle(rank, sock, message, payload)
            except (OSError, KeyError, TypeError, ValueError) as exc:
                self._answer(sock, message, error=f"the grader's relay refused a request ({type(exc).__name__})")

    def _answer(self, sock, message: dict, payload: bytes = b"", error: str = "") -> None:
        try:
            send_frame(sock, {"id": message.get("id"), **({"error": error} if error else {})}, payload)
        except OSError:
            pass

    def _check(self, rank: int) -> str:
        at = self._at[rank]
        return self.order[at - 1] if 0 < at <= len(self.order) else "import"

    def _handle(self, rank: int, sock, message: dict, payload: bytes) -> None:
        op = message["op"]
        if op == "inputs":  # the next check's inputs, once the previous check's result is in
            with self._lock:
                at = self._at[rank]
                if at >= len(self.order) or (at > 0 and rank not in self.results[self.order[at - 1]]):
                    raise ValueError("inputs asked for out of order")
                self._at[rank] = at + 1
            self._answer(sock, message, self.inputs[self.order[at]][rank])
        elif op == "result":
            with self._lock:
                check = self._check(rank)
                self.results[check].setdefault(rank, payload)  # the first one counts
            self._answer(sock, message)
        elif op in ("send", "recv"):
            self._post(rank, sock, message, payload)
        else:
            raise ValueError(op)

    def _post(self, rank: int, sock, message: dict, payload: bytes) -> None:
        peer, numel = message["peer"], message["numel"]
        if not (isinstance(peer, int) and 0 <= peer < self.world_size and isinstance(numel, int) and numel >= 0):
            raise ValueError("a malformed message")
        src, dst = (rank, peer) if message["op"] == "send" else (peer, rank)
        key = (src, dst, str(message["group"]), int(message["tag"]))
        with self._lock:
            self.record[rank][self._check(rank)].append([message["op"], peer, numel])
            if message["op"] == "send":
                if self._held + len(payload) > MAX_HELD:
                    raise ValueError("too many bytes held")
                self._held += len(payload)
                self._sends[key].append((sock, message, payload))
            else:
                self._recvs[key].append((sock, message))
            if not (self._sends[key] and self._recvs[key]):
                return
            (sender, sent, data), (receiver, wanted) = self._sends[key].popleft(), self._recvs[key].popleft()
            self._held -= len(data)
        if (sent["numel"], sent["dtype"]) != (wanted["numel"], wanted["dtype"]):
            said = (
                f"rank {src} sent {sent['numel']} {sent['dtype']} elements to rank {dst}, which posted a "
                f"receive of {wanted['numel']} {wanted['dtype']} (a message doesn't match expected size)"
            )
            self._answer(receiver, wanted, error=said)
            self._answer(sender, sent, error=said)
            return
        self._answer(receiver, wanted, data)
        self._answer(sender, sent)

    def wait_closed(self, seconds: float = 1.0) -> None:
        """Give the ranks' last frames a moment to land (the launch has ended)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and any(t.is_alive() for t in self._threads[1:]):
            time.sleep(0.02)
