"""The grader's relay: it hands every lab's ranks each check's inputs and takes their results (so the grader
times the checks by what it handed out and took in, never by a file a rank wrote: `progress`), and it carries
everything the submission's ranks say to each other, keeping the record the traffic checks read: in a lab whose
ranks may talk only in point-to-point messages (checks.py: `MESSAGES_ONLY = True`), every message; in every other
lab, every collective as well (`_meet`: the members' calls met, checked for agreement, computed here from the
tensors they hand in, each given its share: `relay_meet.py`), recorded per rank and check in `collectives`.

The ranks have no process group of their own (`relay_group.py`): each holds one connection to this
relay, a UNIX socket in the grading's folder, opened with a token only it was sent. A send is held until its
receiver posts the matching receive (same group, tag, source and destination), then delivered; the sender's
work completes then, as gloo's does. What the relay records is what it carried, not what a rank says it sent:
for every rank, each send and receive it posted (kind, peer, elements), with the check it belongs to; a send whose
bytes are not exactly its elements' (a rank writing frames of its own) is refused, never carried. A check
belongs to the span between the rank taking the check's inputs (`{"op": "inputs"}`: the relay gives them only
once the rank has handed in the previous check's result) and handing in its result (`{"op": "result"}`: the
first one counts). So every message a result could depend on is in its check's record: a submission cannot
fetch the inputs early, exchange them in another check's span, and leave ring-shaped decoys where the check
looks. The grader substitutes this record for what the rank reports under `messages` (`verdicts.relayed`).

It runs in the grader's process, in threads: one accepting, one per rank (`relay_frames.FrameServer`: the socket's
end, a frame per request). Everything a rank sends it is read as untrusted frames (capped, checked), never code.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque

import torch

from . import relay_meet
from .relay_frames import FrameServer
from .relay_store import Bookings
from .wire import DTYPES

MAX_MESSAGE = 64 * 2**20  # one message's bytes (a result's too: wire.MAX_BYTES)
MAX_HELD = 256 * 2**20  # bytes of sends held for their receivers, all ranks together
MAX_POSTS = 200_000  # messages one rank may post in a launch (the record of each is kept in the grader's memory;
# lab 13's ring posts a few hundred)
MAX_COLLECTIVES = 50_000  # collectives one rank may call in a launch (each recorded in the grader's memory)


class Relay(FrameServer):
    """`with Relay(folder, n, inputs) as relay:` for one launch; `relay.path`, `relay.tokens[r]` go to the ranks.
    inputs[index][rank]: the wire-encoded inputs of each check (in the order the ranks take them)."""

    max_payload = MAX_MESSAGE

    def __init__(self, folder: str, world_size: int, order: list, inputs: dict):
        self.order, self.inputs = [str(i) for i in order], inputs
        self.results: dict[str, dict[int, bytes]] = defaultdict(dict)
        self.record: dict[int, dict[str, list]] = {r: defaultdict(list) for r in range(world_size)}
        # collectives[rank][check]: what the relay carried for the rank, in the order it called (relay_meet.entry;
        # None for a call never carried: refused, or its peers never came)
        self.collectives: dict[int, dict[str, list]] = {r: defaultdict(list) for r in range(world_size)}
        self._counted: dict[tuple, int] = defaultdict(int)  # (rank, group) -> its collectives on that group so far
        self._meets: dict[tuple, dict] = {}  # (group, k) -> the members' k-th calls on it, until carried
        self.bookings = Bookings()
        self._at = [0] * world_size  # the position in `order` of the check each rank is in (0: importing)
        self._lock = threading.Lock()
        self._held = 0
        self._posts, self._called = [0] * world_size, [0] * world_size
        self._ready = [False] * world_size
        self._sends, self._recvs = defaultdict(deque), defaultdict(deque)  # (src, dst, group, tag) -> posts
        super().__init__(folder, world_size)  # the socket's end: admits each rank by its token (`relay_frames.py`)

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
        elif op == "ready":  # just before the rank imports the submission: no student code has run before
            with self._lock:
                self._ready[rank] = True
            self._answer(sock, message)
        elif op == "result":
            with self._lock:
                check = self._check(rank)
                self.results[check].setdefault(rank, payload)  # the first one counts
            self._answer(sock, message)
        elif op in ("send", "recv"):
            self._post(rank, sock, message, payload)
        elif op == "collective":
            self._meet(rank, sock, message, payload)
        elif op == "booking":  # the emulated link's, shared by every rank (relay_store.py)
            with self._lock:
                booked = self.bookings.handle(message)
            self._answer(sock, message, booked)
        else:
            raise ValueError(op)

    def _post(self, rank: int, sock, message: dict, payload: bytes) -> None:
        peer, numel, dtype = message["peer"], message["numel"], message["dtype"]
        if not (
            isinstance(peer, int)
            and 0 <= peer < self.world_size
            and isinstance(numel, int)
            and numel >= 0
            and dtype in DTYPES
        ):
            raise ValueError("a malformed message")
        carried = numel * torch.empty((), dtype=DTYPES[dtype]).element_size() if message["op"] == "send" else 0
        if len(payload) != carried:  # the record says what was carried: a send holds exactly what it declares
            self._answer(
                sock,
                message,
                error=f"the grader's relay refused a {message['op']} of {numel} {dtype} elements that carried "
                f"{len(payload)} bytes (a message's bytes are its elements', nothing more or less)",
            )
            return
        src, dst = (rank, peer) if message["op"] == "send" else (peer, rank)
        key = (src, dst, str(message["group"]), int(message["tag"]))
        with self._lock:
            if self._posts[rank] >= MAX_POSTS:
                raise ValueError(f"more than {MAX_POSTS} messages posted by one rank in a launch")
            self._posts[rank] += 1
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

    def _meet(self, rank: int, sock, message: dict, payload: bytes) -> None:
        """One rank's call of a collective (`relay_meet.py`): held until every member of its group made its call
        of the same rank in order, then computed, answered and recorded; refused on every member if they
        disagree."""
        try:
            call = relay_meet.validate(rank, message, payload)
        except relay_meet.Refused as exc:
            self._answer(sock, message, error=f"the grader's relay refused a collective: {exc}")
            return
        with self._lock:
            if self._called[rank] >= MAX_COLLECTIVES:
                raise ValueError(f"more than {MAX_COLLECTIVES} collectives called by one rank in a launch")
            if self._held + len(payload) > MAX_HELD:
                raise ValueError("too many bytes held")
            self._called[rank] += 1
            k = self._counted[rank, call["group"]]
            self._counted[rank, call["group"]] = k + 1
            slots = self.collectives[rank][self._check(rank)]
            slots.append(None)
            meet = self._meets.setdefault((call["group"], k), {"members": call["members"], "at": {}, "calls": {}})
            meet["at"][rank] = (sock, message, call, payload, slots, len(slots) - 1)
            meet["calls"][rank] = call
            self._held += len(payload)
            members = meet["members"]
            if "verdict" not in meet:  # "" once every member's call is in and they agree; else why they cannot
                if call["members"] != members:
                    first = next(iter(meet["calls"]))
                    meet["verdict"] = relay_meet.disagreement(meet["calls"], [first, rank], k) or (
                        f"the ranks of group {members} disagree on their {relay_meet.ordinal(k)} collective's group: "
                        f"rank {first} calls it on ranks {members}, rank {rank} on {call['members']}"
                    )
                elif set(meet["calls"]) == set(members):
                    meet["verdict"] = relay_meet.disagreement(meet["calls"], members, k)
            if "verdict" not in meet:
                return
            posted = [(r, *meet["at"].pop(r)) for r in list(meet["at"])]
            self._held -= sum(len(at[4]) for at in posted)
            if set(members) <= set(meet["calls"]):
                del self._meets[call["group"], k]
        if meet["verdict"]:  # refused: every member that called it hears why (the later ones as they call)
            for _, their_sock, their_message, *_ in posted:
                self._answer(their_sock, their_message, error=meet["verdict"])
            return
        calls = {r: c for r, _, _, c, _, _, _ in posted}
        shares = relay_meet.results(calls, {r: p for r, _, _, _, p, _, _ in posted}, members)
        for r, their_sock, their_message, their_call, _, their_slots, slot in posted:
            with self._lock:
                their_slots[slot] = relay_meet.entry(r, their_call)
            self._answer(their_sock, their_message, shares[r])

    def all_ready(self) -> bool:
        """Every rank said it is ready (got as far as importing the submission): what ran before is the grader's."""
        with self._lock:
            return all(self._ready)

    def progress(self) -> list[int]:
        """How far each rank has come, by what this relay handed out and took in: the phases it finished (the
        import, once it took the first check's inputs; then each check whose result it handed in). Only the
        relay moves it, one check at a time."""
        with self._lock:
            return [
                min(self._at[r], 1) + sum(r in self.results.get(check, {}) for check in self.order)
                for r in range(self.world_size)
            ]
