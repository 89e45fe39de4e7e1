"""What a student reads when no rank can finish a check: where each rank waits, and what that usually means.

The watchdogs (`watchdog.py`) find the ranks stuck; this turns where they are (the line of the student's file,
the distributed call below it) into the check's message: a deadlock (every rank blocked, each waiting for
another) or a one-sided wait (some ranks wait for peers that already finished), with the hint for the classic
mistake (a ring of blocking sends).
"""

from __future__ import annotations

import os


def at_line(where: dict, solution: str) -> str:
    if where.get("line") is None:
        return ""
    text = f" (`{where['text']}`)" if where.get("text") else ""
    return f" at {os.path.basename(solution)} line {where['line']}{text}"


def describe_deadlock(stuck: dict, done: list, solution: str, stall_s: float) -> str:
    """The story of a check no rank can finish: where each rank waits, and what that usually means."""
    lines = []
    if done:
        lines.append(
            f"rank{'s' * (len(stuck) > 1)} {', '.join(map(str, sorted(stuck)))} waited more than "
            f"{stall_s:.0f} s for messages that no rank will send: rank{'s' * (len(done) > 1)} "
            f"{', '.join(map(str, done))} already finished this check."
        )
    else:
        lines.append(
            f"deadlock: every rank has been blocked for more than {stall_s:.0f} s, each waiting "
            "for another; no rank can make progress, so the grading stopped here."
        )
    for r, where in sorted(stuck.items()):
        call = f" in {where['call']}" if where.get("call") else ""
        lines.append(f"  rank {r} is blocked{at_line(where, solution)}{call}")
    calls = {w.get("call", "") for w in stuck.values()}
    if not done and calls and all(c.endswith("send") and "isend" not in c for c in calls):
        lines.append(
            "  hint: every rank is in a blocking send, and a blocking send returns only once the "
            "receiver has posted its receive, which no rank reaches. Post the send and the receive "
            "together (dist.isend and dist.irecv, or dist.batch_isend_irecv), then wait for both."
        )
    elif not done:
        lines.append(
            "  hint: every wait needs a matching send on the peer, posted before that peer waits itself; "
            "check that all ranks run the same steps in the same order."
        )
    return "\n".join(lines)
