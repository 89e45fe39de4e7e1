"""The grader's side of a collective (labs 02-12): the relay meets every member's call, checks they agree, computes
the result from the tensors they handed in, gives each its share, and records what it carried.

A rank's k-th collective on a group meets the k-th of every other member (the relay counts them, per rank and group:
a rank cannot say which call it means). When the last member's call arrives, the calls must agree on the kind, the
group's ranks, the dtype, the elements per rank, the reduce op and the root; an all-to-all's split sizes must agree
pairwise (what rank i sends rank j is what rank j expects from rank i). A call that disagrees is refused, on every
member, with a message naming both calls; nothing waits for it. The input bytes must be exactly what the call
declares. The result is computed here (a sum in rank order, in the tensors' dtype, as a ring of adds would), so
a rank cannot have its result without its peers handing in theirs.

The record (`entry`) has the shape of `toolkit.comm`'s trace (`{"name", "args": {group, dtype, numel, size_bytes,
bytes_sent, bytes_recv, ...}}`), with the bytes on the wire counted as the lessons' ring algorithms move them
(`toolkit/comm/collectives.py`: all-reduce 2(N-1)/N of the message per rank, reduce-scatter and all-gather
(N-1)/N, broadcast the root's message, all-to-all exactly what leaves the rank), computed here from what was
carried. An all-to-all's `sent`/`received` are its split sizes in elements. Reduce, gather and scatter (which
`toolkit.comm` does not issue) count the chunks that leave and reach each rank.
"""

from __future__ import annotations

import torch

from .wire import DTYPES

KINDS = ("all_reduce", "reduce", "broadcast", "barrier", "all_gather", "gather", "reduce_scatter", "scatter")
KINDS += ("all_to_all",)
ROOTED = ("reduce", "broadcast", "gather", "scatter")
REDUCED = ("all_reduce", "reduce", "reduce_scatter")
REDUCE = {"sum": torch.add, "product": torch.mul, "min": torch.minimum, "max": torch.maximum}
AGREE = ("kind", "members", "dtype", "reduce", "root")


class Refused(ValueError):
    """A call the relay will not carry; the message says why, in the words of `torch.distributed`."""


def ordinal(k: int) -> str:
    return f"{k + 1}{'th' if 10 <= (k + 1) % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get((k + 1) % 10, 'th')}"


def validate(rank: int, call: dict, payload: bytes) -> dict:
    """The call as the relay reads it (a malformed one refused); `rank` must be one of its members."""
    kind, members, dtype, size = call.get("kind"), call.get("members"), call.get("dtype"), call.get("size")
    if kind not in KINDS or dtype not in DTYPES or not isinstance(size, int) or size < 0:
        raise Refused("a malformed collective")
    if not (isinstance(members, list) and all(isinstance(m, int) for m in members) and rank in members):
        raise Refused("a collective on a group this rank is not a member of")
    if len(set(members)) != len(members):
        raise Refused("a collective on a group that names a rank twice")
    n = len(members)
    clean = {"kind": kind, "members": members, "dtype": dtype, "size": size, "group": str(call.get("group"))}
    clean["reduce"] = call.get("reduce") if kind in REDUCED else None
    if kind in REDUCED and clean["reduce"] not in REDUCE:
        raise Refused(f"dist.{kind} with the reduce op {clean['reduce']!r}: the relay carries {', '.join(REDUCE)}")
    clean["root"] = call.get("root") if kind in ROOTED else None
    if kind in ROOTED and clean["root"] not in members:
        raise Refused(f"dist.{kind} from a root that is not in the group {members}")
    if kind == "all_to_all":
        sent, received = call.get("sent"), call.get("received")
        for splits in (sent, received):
            if not (
                isinstance(splits, list) and len(splits) == n and all(isinstance(s, int) and s >= 0 for s in splits)
            ):
                raise Refused(f"dist.all_to_all needs one split size per rank of the group ({n})")
        if sum(sent) != size:
            raise Refused("dist.all_to_all: the split sizes do not add up to the input")
        clean.update(sent=sent, received=received)
    me = rank == clean["root"]
    handed = {
        "reduce_scatter": n * size,
        "scatter": n * size if me else 0,
        "broadcast": size if me else 0,
        "barrier": 0,
    }.get(kind, size)
    element = torch.empty((), dtype=DTYPES[dtype]).element_size()
    if len(payload) != handed * element:
        raise Refused(
            f"dist.{kind}: {len(payload)} bytes handed in for {handed} {dtype} elements (a collective's bytes are "
            "its elements', nothing more or less)"
        )
    return clean


def _described(rank: int, call: dict) -> str:
    shape = f"{call['size']} {call['dtype']} elements per rank"
    if call["kind"] == "all_to_all":
        shape = f"{call['dtype']} elements sent {call['sent']}, received {call['received']}"
    extra = "".join(f", {k} {call[k]}" for k in ("reduce", "root") if call[k] is not None)
    return f"rank {rank} called {call['kind']} ({shape}{extra})"


def disagreement(calls: dict, members: list, k: int) -> str:
    """Why the members' k-th calls on one group cannot be one collective ("" when they agree)."""
    first = members[0]
    for r in members[1:]:
        a, b = calls[first], calls[r]
        differs = [key for key in AGREE if a[key] != b[key]]
        if not differs and a["kind"] != "all_to_all" and a["size"] != b["size"]:
            differs = ["size"]
        if differs:
            return (
                f"the ranks of group {members} disagree on their {ordinal(k)} collective: {_described(first, a)}, "
                f"{_described(r, b)} (they differ in {', '.join(differs)}). Every rank of a group must call the same "
                "collectives in the same order, with the same shapes and dtypes"
            )
    if calls[first]["kind"] == "all_to_all":
        for i, r in enumerate(members):
            for j, s in enumerate(members):
                if calls[r]["sent"][j] != calls[s]["received"][i]:
                    return (
                        f"the ranks of group {members} disagree on their {ordinal(k)} collective, an all-to-all: rank "
                        f"{r} sends rank {s} {calls[r]['sent'][j]} elements, rank {s} expects "
                        f"{calls[s]['received'][i]} from rank {r} (every rank's split sizes must match its peers')"
                    )
    return ""


def _reduced(tensors: list, op: str) -> torch.Tensor:
    out = tensors[0].clone()
    for t in tensors[1:]:  # in rank order, in the dtype: as a chain of adds would
        out = REDUCE[op](out, t)
    return out


def results(calls: dict, payloads: dict, members: list) -> dict:
    """Each member's share (bytes) of the collective the agreeing `calls` make, from what they handed in."""
    call = calls[members[0]]
    kind, size, root = call["kind"], call["size"], call["root"]
    dtype = DTYPES[call["dtype"]]
    given = {r: torch.frombuffer(bytearray(payloads[r]), dtype=torch.uint8).view(dtype) for r in members if payloads[r]}

    def raw(t: torch.Tensor) -> bytes:
        return t.contiguous().view(torch.uint8).numpy().tobytes()

    if kind == "barrier":
        return {r: b"" for r in members}
    if kind in ("all_reduce", "reduce"):
        total = raw(_reduced([given[r] for r in members], call["reduce"]))
        return {r: total if kind == "all_reduce" or r == root else b"" for r in members}
    if kind == "broadcast":
        return {r: b"" if r == root else payloads[root] for r in members}
    if kind in ("all_gather", "gather"):
        whole = b"".join(payloads[r] for r in members)
        return {r: whole if kind == "all_gather" or r == root else b"" for r in members}
    if kind == "reduce_scatter":
        total = _reduced([given[r] for r in members], call["reduce"])
        return {r: raw(total[i * size : (i + 1) * size]) for i, r in enumerate(members)}
    if kind == "scatter":
        return {r: raw(given[root][i * size : (i + 1) * size]) for i, r in enumerate(members)}
    # all_to_all: rank j's share is every rank's chunk for j, in rank order
    chunks = {r: list(given.get(r, torch.empty(0, dtype=dtype)).split(calls[r]["sent"])) for r in members}
    return {s: b"".join(raw(chunks[r][j]) for r in members) for j, s in enumerate(members)}


def entry(rank: int, call: dict) -> dict:
    """What the record says rank `rank` carried in this collective, as `toolkit.comm`'s trace says it."""
    kind, members, size = call["kind"], call["members"], call["size"]
    n, me = len(members), members.index(rank)
    element = torch.empty((), dtype=DTYPES[call["dtype"]]).element_size()
    numel = n * size if kind in ("all_gather", "gather", "reduce_scatter", "scatter") else size
    message = numel * element
    sent = received = 0
    if kind == "all_reduce":
        sent = received = 2 * (n - 1) * message // n
    elif kind in ("all_gather", "reduce_scatter"):
        sent = received = (n - 1) * message // n
    elif kind == "broadcast":
        sent, received = (message, 0) if rank == call["root"] else (0, message)
    elif kind in ("reduce", "gather"):
        chunk = size * element
        sent, received = (0, (n - 1) * chunk) if rank == call["root"] else (chunk, 0)
    elif kind == "scatter":
        chunk = size * element
        sent, received = ((n - 1) * chunk, 0) if rank == call["root"] else (0, chunk)
    elif kind == "all_to_all":
        sent = (sum(call["sent"]) - call["sent"][me]) * element
        received = (sum(call["received"]) - call["received"][me]) * element
    args = {
        "group": members,
        "dtype": call["dtype"],
        "numel": numel,
        "size_bytes": message,
        "bytes_sent": sent,
        "bytes_recv": received,
    }
    args.update({k: call[k] for k in ("reduce", "root", "sent", "received") if call.get(k) is not None})
    return {"name": kind, "args": args}
