"""What the ranks of one launch sent back, judged: one check at one world size passes ("") or fails with why.

The grader (`grader.py`) and the mutants' grading (`mutants.py`) read a launch (`session.Launch`) the same way:
the first failure in time is the one a student sees (its echoes on the peers come later); a launch that ended in
a check tells the launcher's story (`crash_story`); a traffic check judges what the grader's relay carried, never
what a rank says it sent (`relayed`); and the judge runs only on what every rank observed (`verdict`).
"""

from __future__ import annotations

from . import delegation
from .checks import Check, CheckFailed
from .session import Launch


def crash_story(found: Launch) -> str:
    """What ended a launch early, in a few lines: the launcher's summary and the rank's last words."""
    if found.overran:
        return "the ranks ran past the grading's deadline and were stopped"
    if found.error is None:
        return "the ranks stopped without a result"
    lines = found.error["message"][:4000].splitlines() or ["the ranks stopped"]
    rank = found.error.get("rank")
    where = [line for line in lines[1:] if line.startswith("  rank ")]  # the launcher's "where every rank was"
    said = found.of_rank(rank) if isinstance(rank, int) else []
    story = "\n".join(
        [lines[0]]
        + [f"  rank {rank} printed: {line}" for line in said]
        + (["  where every rank was:"] + where if where else [])
    )
    if "doesn't match expected size" in story:
        story += (
            "\n  hint: a rank received a bigger message than the buffer it posted: do sender and "
            "receiver agree on which chunk moves at this step, and on its size?"
        )
    return story


def first_failure(results: dict) -> tuple[int, str] | None:
    """(rank, message) of the failure that came first in time (its echoes on peers come later), if any."""
    failed = {r: v for r, v in results.items() if not isinstance(v, dict) or v.get("error")}
    if not failed:
        return None
    times = {
        r: v.get("time", 0.0) if isinstance(v, dict) and isinstance(v.get("time"), (int, float)) else 0.0
        for r, v in failed.items()
    }
    earliest = min(times.values())
    first = min(r for r in failed if times[r] < earliest + 0.5)
    others = sorted(set(failed) - {first})
    message = failed[first].get("error") if isinstance(failed[first], dict) else None
    message = message if isinstance(message, str) else f"rank {first} sent something the grader cannot read"
    also = f" (rank{'s' * (len(others) > 1)} {', '.join(map(str, others))} failed too)" if others else ""
    return first, message[:4000] + also


def verdict(check: Check, n: int, given: list, results: dict, found: Launch) -> str:
    """One check at world size n: "" if the judge accepts what every rank observed, else why not."""
    prefix = "" if check.pure else f"world size {n}, "
    used = sorted(
        {
            u
            for v in results.values()
            if isinstance(v, dict) and isinstance(v.get("delegated"), list)
            for u in v["delegated"]
            if isinstance(u, str)
        }
    )
    if used:  # first: in the students' toolkit the answer only raises, and that failure would hide why
        return prefix + delegation.delegation_message([f"{u} (called while this check ran)" for u in used])
    failure = first_failure(results)
    if failure:
        return prefix + (failure[1].removeprefix("rank 0: ") if check.pure else failure[1])
    if len(results) < n:
        return f"{prefix.rstrip(', ')}: {crash_story(found)}" if prefix else crash_story(found)
    try:
        check.verdict(n, given, [results[r].get("ok") for r in range(n)])  # the contract, then the judge per case
    except CheckFailed as exc:
        return prefix + str(exc)
    except Exception as exc:  # noqa: BLE001 - what the ranks sent is not what a right answer looks like
        return prefix + f"your results could not be checked ({type(exc).__name__}: {str(exc)[:300]})"
    return ""


def relayed(results: dict, found: Launch, index) -> dict:
    """What a rank reports of its traffic is replaced by what the grader's relay carried for it during that check
    (`relay.py`): in a messages-only lab, whatever the task returns under `messages`; elsewhere, every mark a task
    returned for its collectives (`Rank.comm_events`: `{"relay_span": [start, end]}`) becomes the relay's record of
    that span. The record a traffic check judges is never the rank's word."""
    if found.relayed is None:
        return results
    carried = found.relayed.get(index, {})

    def put(value, record: list):
        if found.relayed_kind == "messages" and isinstance(value, dict):
            return {k: record if k == "messages" else put(v, record) for k, v in value.items()}
        if isinstance(value, dict) and set(value) == {"relay_span"}:
            span = value["relay_span"]
            ok = isinstance(span, list) and len(span) == 2 and all(type(i) is int and i >= 0 for i in span)
            return [e for e in record[span[0] : span[1]] if e is not None] if ok else value
        if isinstance(value, dict):
            return {k: put(v, record) for k, v in value.items()}
        if isinstance(value, list):
            return [put(v, record) for v in value]
        return value

    return {
        r: {**v, "ok": put(v["ok"], carried.get(r, []))} if isinstance(v, dict) and "ok" in v else v
        for r, v in results.items()
    }
