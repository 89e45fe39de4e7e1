"""How the grader's relay and a lab's ranks talk: frames on a UNIX socket in the grading's folder.

A frame is a JSON message (at most 64 KiB) and a payload of raw bytes, each preceded by its length. Both ends use
`send_frame` and `read_frame`; the ranks' end is `relay_group._Link`. `FrameServer` is the relay's end: it admits
each rank once, by the token only that rank was sent (anything else is closed unanswered), reads its frames on a
thread of its own, and answers each request by its id. What a request means is the subclass's `_handle`
(`relay.Relay`); a frame past the cap ends that rank's link, and a request `_handle` refuses is answered with
the reason. Everything a rank sends is read as untrusted frames (capped, checked), never code.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import struct
import threading
import time
from collections import defaultdict

HEADER = struct.Struct("!II")  # the JSON's length, the payload's length
MAX_JSON = 1 << 16


def send_frame(sock: socket.socket, message: dict, payload: bytes = b"") -> None:
    body = json.dumps(message).encode()
    sock.sendall(HEADER.pack(len(body), len(payload)) + body + payload)


def _exactly(sock: socket.socket, size: int) -> bytes | None:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(min(size - len(data), 1 << 20))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def read_frame(sock: socket.socket, max_bytes: int) -> tuple[dict, bytes] | None:
    """(message, payload), or None at the end of the stream; ValueError for a frame past `max_bytes`."""
    head = _exactly(sock, HEADER.size)
    if head is None:
        return None
    size, payload_size = HEADER.unpack(head)
    if size > MAX_JSON or payload_size > max_bytes:
        raise ValueError(f"a frame of {size} + {payload_size} bytes, more than the relay carries")
    body, payload = _exactly(sock, size), _exactly(sock, payload_size) if payload_size else b""
    if body is None or payload is None:
        return None
    return json.loads(body), payload


class FrameServer:
    """The relay's socket at `folder`/relay.sock: `tokens[r]` admits rank r (once); each request a rank sends is
    handed to `_handle(rank, sock, message, payload)`, which answers it with `_answer`."""

    max_payload = 0  # the bytes one frame may carry (set by the subclass)

    def __init__(self, folder: str, world_size: int):
        self.world_size = world_size
        self.tokens = [secrets.token_hex(16) for _ in range(world_size)]
        self.path = os.path.join(folder, "relay.sock")
        self._ranks: dict[int, socket.socket] = {}
        self._writing: dict[int, threading.Lock] = defaultdict(threading.Lock)  # one answer at a time per socket
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if os.path.lexists(self.path):  # the last launch's
            os.unlink(self.path)
        self._server.bind(self.path)
        os.chmod(self.path, 0o666)  # the ranks may run as another user; the token says who is who
        self._server.listen(world_size)
        self._threads = [threading.Thread(target=self._accept, daemon=True, name="grading-relay")]
        self._threads[0].start()

    def _handle(self, rank: int, sock: socket.socket, message: dict, payload: bytes) -> None:
        raise NotImplementedError

    def __enter__(self):
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

    def wait_closed(self, seconds: float = 1.0) -> None:
        """Give the ranks' last frames a moment to land (the launch has ended)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and any(t.is_alive() for t in self._threads[1:]):
            time.sleep(0.02)

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
                frame = read_frame(sock, self.max_payload)
            except (OSError, ValueError):
                frame = None
            if frame is None:  # the end, or a frame past the cap: the rank's link ends (it waits on nothing)
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return
            message, payload = frame
            try:
                self._handle(rank, sock, message, payload)
            except (OSError, KeyError, TypeError, ValueError) as exc:
                said = f": {str(exc)[:200]}" if isinstance(exc, ValueError) else ""
                self._answer(sock, message, error=f"the grader's relay refused a request ({type(exc).__name__}{said})")

    def _answer(self, sock: socket.socket, message: dict, payload: bytes = b"", error: str = "") -> None:
        try:
            with self._writing[sock.fileno()]:
                send_frame(sock, {"id": message.get("id"), **({"error": error} if error else {})}, payload)
        except OSError:
            pass
