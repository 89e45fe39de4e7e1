"""Who caused a failure, told apart from what it did to the other ranks.

When one rank fails, the others usually fail moments later: their collective loses a partner
("Connection closed by peer"), times out, or they learn that another rank could not go on. Those are
*consequences*. The *cause* is a rank that raised on its own, died (an exit code or a signal), or never
entered a collective its peers were waiting in. `judge` weighs every rank's evidence and names the
cause first, the consequences below it as such, then where every rank was.
"""

from __future__ import annotations

from dataclasses import dataclass

from .exits import signal_name
from .exits import story as exit_story
from .status import FAILED, INSIDE, Snapshot


class Consequence(Exception):
    """Mixed into an error a rank raises only because another rank failed (ranked below causes)."""


# What gloo and NCCL say when the peer, not this rank, is the problem.
PEER_SIGNS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out waiting",
    "application timeout caused pair closure",
    "communicator was aborted",
    "watchdog caught collective operation timeout",
    "socket timeout",
    "wait timeout after",
)


def is_consequence(exc: BaseException) -> bool:
    """True if `exc`, or an error it was raised from, says another rank failed first."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, Consequence) or reads_as_consequence("", str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def reads_as_consequence(type_name: str, message: str) -> bool:
    """The same test on an error known only by its type's name and its text (a remote engine's)."""
    return type_name in ("PeerFailed", "AnotherRankCouldNotLoad") or any(s in message.lower() for s in PEER_SIGNS)


@dataclass
class Evidence:
    """What the launcher knows about one rank."""

    rank: int
    board: Snapshot | None = None
    error: dict | None = None  # what the rank wrote when it raised (see worker.py)
    code: int | None = None  # exit code once it ended (negative: the signal that killed it)
    ended_at: float | None = None  # when the launcher saw it end
    returned: bool = False  # it wrote its result


@dataclass
class Verdict:
    rank: int | None  # the rank named first
    found_cause: bool  # False: only consequences seen so far
    headline: str
    lines: list[str]  # more causes, consequences, where every rank was
    traceback: str = ""

    def message(self) -> str:
        text = "\n".join([self.headline] + self.lines)
        if self.traceback:
            text += f"\n\ntraceback of rank {self.rank}:\n{self.traceback}"
        return text


def judge(evidence: list[Evidence], now: float, timeout_s: float) -> Verdict | None:
    """Name the cause of a failure (None while nothing has gone wrong)."""
    causes = []  # (time, rank, headline)
    for e in evidence:
        if e.error is not None and not e.error.get("consequence"):
            causes.append((e.error["time"], e.rank, f"rank {e.rank} raised {e.error['type']}: {e.error['message']}"))
        elif e.error is None and e.code not in (None, 0):
            causes.append((e.ended_at or now, e.rank, f"rank {e.rank} {exit_story(e.code)}"))
        elif e.error is None and e.code == 0 and not e.returned:
            causes.append(
                (
                    e.ended_at or now,
                    e.rank,
                    f"rank {e.rank} exited with code 0 without returning from its function (os._exit(0) inside it?)",
                )
            )
    named = {rank for _, rank, _ in causes}
    causes += [c for c in _absent(evidence, now, timeout_s) if c[1] not in named]
    consequences = [e for e in evidence if e.error is not None and e.error.get("consequence")]
    where = where_every_rank_was(evidence, now)
    if causes:
        causes.sort()
        _, rank, headline = causes[0]
        same = [r for _, r, h in causes[1:] if h.split(" ", 2)[2] == headline.split(" ", 2)[2]]  # minus "rank N"
        lines = [f"  (rank{'s' * (len(same) > 1)} {', '.join(map(str, same))} failed the same way)"] if same else []
        lines += [f"also on its own: {h}" for _, r, h in causes[1:] if r not in same]
        if consequences:
            lines.append("consequences (these ranks failed because of the above, not on their own):")
            lines += [f"  - rank {e.rank}: {e.error['message'].splitlines()[0]}" for e in consequences]
        error = next((e.error for e in evidence if e.rank == rank), None)
        return Verdict(rank, True, headline, lines + where, error["traceback"] if error else "")
    if consequences:
        first = min(consequences, key=lambda e: e.error["time"])
        return Verdict(
            first.rank,
            False,
            f"rank {first.rank} raised {first.error['type']}: {first.error['message']}",
            ["(an error caused by another rank, but no rank was seen raising, dying or skipping a collective)"] + where,
            first.error["traceback"],
        )
    return _hung(evidence, now, timeout_s, where)


def _absent(evidence, now, timeout_s) -> list[tuple]:
    """Ranks that never entered a collective their peers waited in past timeout_s (or failed in)."""
    boards = {e.rank: e.board for e in evidence if e.board is not None}
    waiting: dict[tuple, dict] = {}  # (group, number) -> {rank: (entry, since, failed)}
    for rank, b in boards.items():
        if b.entry is not None and b.entry.group and b.state in (INSIDE, FAILED):
            waiting.setdefault((b.entry.group, b.entry.number), {})[rank] = (b.entry, b.since, b.state == FAILED)
    found = []
    for (group, number), inside in waiting.items():
        entry, since, _ = min(inside.values(), key=lambda v: v[1])
        if not any(failed for *_, failed in inside.values()) and now - since <= timeout_s:
            continue  # nobody has waited too long yet
        ops = {v[0].op for v in inside.values()}
        absent = [m for m in group if m not in inside and (m not in boards or boards[m].entered(group) < number)]
        waiters = ", ".join(map(str, sorted(inside)))
        if len(ops) > 1:  # the ranks are in the same call by number, but not the same collective
            count = {op: [r for r, v in inside.items() if v[0].op == op] for op in ops}
            odd = min(ops, key=lambda op: len(count[op]))
            for r in count[odd]:
                others = ", ".join(f"{op} on rank(s) {count[op]}" for op in sorted(ops) if op != odd)
                found.append(
                    (
                        since,
                        r,
                        f"rank {r} called {odd} #{number} (group {list(group)}) where the others "
                        f"called {others}: collective calls must match on every rank",
                    )
                )
        elif absent and len(inside) < len(absent):  # one rank called a collective the others never did
            for r in sorted(inside):
                found.append(
                    (
                        since,
                        r,
                        f"rank {r} entered {entry.label()} but ranks {absent} never did: "
                        f"an extra call on rank {r}, or a call every other rank skipped",
                    )
                )
        else:
            for r in absent:
                found.append(
                    (
                        since,
                        r,
                        f"rank {r} did not enter {entry.label()}: rank{'s' * (len(inside) > 1)} "
                        f"{waiters} waited in it for {max(0.0, now - since):.1f}s "
                        f"(timeout_s={timeout_s:g}). A collective completes only when every rank "
                        "of its group calls it: look at what rank "
                        f"{r} did instead (below)",
                    )
                )
    return found


def _hung(evidence, now, timeout_s, where) -> Verdict | None:
    """A rank inside something (every peer in it too, or free text) for longer than timeout_s."""
    inside = [(now - e.board.since, e) for e in evidence if e.board is not None and e.board.state == INSIDE]
    if not inside:
        return None
    waited, stuck = max(inside, key=lambda item: item[0])
    if waited <= timeout_s:
        return None
    idle = [e.rank for e in evidence if e.board is None or e.board.state != INSIDE]
    return Verdict(
        stuck.rank,
        True,
        f"rank {stuck.rank} hung for {waited:.0f}s in {stuck.board.entry.describe()} "
        f"(timeout_s={timeout_s:g}); all ranks were stopped. Ranks not in any collective: {idle or 'none'}.",
        where
        + [
            "A collective completes only when every rank of its group calls it: look for a rank "
            "that skipped it or called another one."
        ],
    )


def where_every_rank_was(evidence: list[Evidence], now: float) -> list[str]:
    """The status table: one line per rank (the grader shows the lines that start with "  rank ")."""
    return ["where every rank was:"] + [f"  rank {e.rank}: {_where(e, now)}" for e in evidence]


def _where(e: Evidence, now: float) -> str:
    b = e.board
    if b is None or b.entry is None:
        doing = "not in a collective (none entered yet)"
    elif b.state == INSIDE:
        doing = f"in {b.entry.describe()} for {now - b.since:.1f}s"
    elif b.state == FAILED:
        doing = f"failed in {b.entry.describe()}"
    else:
        doing = f"not in a collective (last entered: {b.entry.describe()})"
    if e.returned:
        return f"{doing}; returned its result"
    if e.error is not None:
        if e.error.get("consequence"):
            return f"{doing}; failed because another rank did ({e.error['type']})"
        return f"{doing}; raised {e.error['type']}"
    if e.code not in (None, 0):
        return f"{doing}; dead ({signal_name(-e.code) if e.code < 0 else f'exit code {e.code}'})"
    return doing
