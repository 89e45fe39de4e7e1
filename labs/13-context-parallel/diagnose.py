"""Lab 13's classic mistakes, recognised in what the ranks returned, so that a message names the mistake instead of
showing floats. Loaded by checks.py (grader's side); each function gets the grader's own copy of a case.

    the merge        overflow (no max subtracted), nan from a block that saw no key, weights that do not add up to
                     1 (not renormalised), the exponent's sign reversed, the weights swapped, an lse that is not
                     log(e^lse1 + e^lse2)
    the rings        the diagonal block without the causal mask, an earlier block with it, a later block attended,
                     a block never attended (the last step missing), the block in hand off by one, the blocks going
                     the wrong way round; a block's gradient short of some ranks' shares, or left on another rank
    the traffic      a message to anyone but the ring's neighbours, a pass too many or too few
    the order        a pass waited for before any block's attention ran while it travelled, a message never waited
"""

import itertools
import math

import torch

from toolkit.grading import show
from toolkit.parallel.context import block as kernel

TREATMENTS = (None, "all", "causal")  # what a rank's queries attend of one block: nothing, every key, the causal mask
LOOSE = dict(rtol=1e-4, atol=1e-4)  # for recognising a pattern, in float32 too


# --- attention by its definition -----------------------------------------------------------------------------
def softmax_attention(scores, values):
    """(out, lse) from the scores (-inf: a key not seen; a query that sees none gets out 0, lse -inf) and values."""
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.where(torch.isinf(lse).unsqueeze(-1), 0.0, torch.exp(scores - lse.unsqueeze(-1)))
    return weights @ values, lse


def attention(q, k, v, seen):
    """Softmax attention of queries q over keys k, values v, where seen[i, j] says whether query i sees key j."""
    return softmax_attention((q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~seen, float("-inf")), v)


def triangle(length: int, causal: bool) -> torch.Tensor:
    """Which keys of a block each query sees: all of them, or (causal) keys 0..i for query i."""
    ones = torch.ones(length, length, dtype=torch.bool)
    return ones.tril() if causal else ones


def whole_attention(q, k, v, grad, causal: bool) -> dict:
    """The whole sequence in one process: out, lse and the gradients of q, k, v for the output's gradient `grad`."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention(*leaves, triangle(q.shape[2], causal))
    (out * grad).sum().backward()
    return {"out": out.detach(), "lse": lse.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


def _close(a, b, atol) -> bool:
    return a.shape == b.shape and bool(torch.isclose(a, b, rtol=atol, atol=atol).all())


def _differs(name: str, got, expected, atol) -> str:
    wrong = (~torch.isclose(got, expected, rtol=atol, atol=atol)).flatten().nonzero().flatten()
    first = int(wrong[0]) if len(wrong) else 0
    return (
        f"{name}: got {show(got)} expected {show(expected)} ({len(wrong)} of {got.numel()} values differ; first "
        f"at {first}: {got.flatten()[first].item():.6g} instead of {expected.flatten()[first].item():.6g})"
    )


# --- the merge -----------------------------------------------------------------------------------------------
def merge_mistake(case: dict, got: dict, out, lse, tolerance: dict) -> str | None:
    """What is wrong with a merge's (out, lse), when it is a mistake this lab knows; None otherwise (or if right)."""
    out1, lse1, out2, lse2 = (case[name].double() for name in ("out1", "lse1", "out2", "lse2"))
    got_out, got_lse = got["out"].double(), got["lse"].double()
    if not (torch.isfinite(got_out).all() and torch.isfinite(got_lse).all()):
        if torch.isinf(torch.cat([lse1, lse2])).any():
            return (
                "nan or inf where a block saw no key (its lse is -inf and its output 0): that block's weight must "
                "come out as e^-inf = 0, and an expression such as -inf - (-inf) or 0 · inf is nan"
            )
        if max(lse1.max(), lse2.max()) > 80:
            return (
                f"nan or inf at scores this large (lse up to {max(lse1.max(), lse2.max()).item():.0f}; e^710 "
                "is inf in float64, e^89 in float32): subtract the larger of lse1 and lse2 before exponentiating, "
                "so that no exponent is above 0 (the result does not change)"
            )
        return "nan or inf in the result, where every value is finite"
    rows = torch.isfinite(lse1) & torch.isfinite(lse2)  # where both blocks saw keys: the weights can be read
    share1, share2 = torch.exp(lse1 - lse.double()), torch.exp(lse2 - lse.double())
    if not _close(got["out"], out, tolerance["atol"]) and rows.any():
        basis = torch.stack([out1, out2], dim=-1)[rows]  # (rows, head_dim, 2): got = a·out1 + b·out2
        a, b = torch.linalg.lstsq(basis, got_out[rows].unsqueeze(-1)).solution.squeeze(-1).unbind(-1)
        if _close(torch.stack([a, b]), torch.stack([share2[rows], share1[rows]]), LOOSE["atol"]):
            return (
                "out1 is weighted by the second block's share of the normaliser and out2 by the first's: the "
                "weights swapped, or the exponents' sign reversed (e^(m - lse_i), renormalised, is exactly that)"
            )
        if _close(a, 1 / share1[rows], LOOSE["atol"]):
            return (
                "the exponents' sign is reversed: out1's weight is e^(lse - lse1), at least 1; a block's weight "
                "is its share of the whole normaliser, e^(lse1 - lse), at most 1"
            )
        total = a + b
        if not _close(total, torch.ones_like(total), LOOSE["atol"]):
            k = int((total - 1).abs().argmax())
            return (
                f"the weights of out1 and out2 add up to {total[k].item():.4g} (for one query), not 1: the merged "
                "output is a weighted average of the two, each block weighted by its share of the whole "
                "normaliser, e^(lse_i - lse) with lse the merged one (not renormalised?)"
            )
    if not _close(got["lse"], lse, tolerance["atol"]):
        if _close(got_lse, torch.maximum(lse1, lse2), LOOSE["atol"]):
            return (
                "lse is the larger of lse1 and lse2: the two normalisers add, so lse = log(e^lse1 + e^lse2), "
                "the larger plus log(1 + e^-(their difference))"
            )
        if _close(got_lse[rows], (lse1 + lse2)[rows], LOOSE["atol"]):
            return "lse is lse1 + lse2: the normalisers add, not their logs: lse = log(e^lse1 + e^lse2)"
    return None


# --- the rings: which blocks, with which mask ----------------------------------------------------------------
def expected_treatments(p: int, n: int, causal: bool) -> list:
    """What position p of a ring of n attends of each block under a contiguous split (the definition of causal
    attention: a query sees the keys at or before it)."""
    return ["all" if not causal or j < p else "causal" if j == p else None for j in range(n)]


def _seen(treatments, length: int) -> torch.Tensor:
    return torch.cat(
        [
            torch.zeros(length, length, dtype=torch.bool) if t is None else triangle(length, t == "causal")
            for t in treatments
        ],
        dim=1,
    )


def _said(treatments, expected, p: int, ring: list) -> str:
    parts = []
    for j, (t, e) in enumerate(zip(treatments, expected)):
        who = "its own block" if j == p else f"rank {ring[j]}'s block"
        if t == e:
            continue
        if e == "causal" and t == "all":
            parts.append("its own block (the diagonal) without the causal mask")
        elif t == "causal":
            parts.append(f"{who} with the causal mask")
        elif t == "all":
            parts.append(f"all of {who}, whose keys all come after its queries")
        else:
            parts.append(f"nothing of {who}")
    return "; ".join(parts)


def _likely(treatments, expected, p: int, n: int) -> str:
    t, e = list(treatments), expected
    if n > 2 and t == [e[(2 * p - j) % n] for j in range(n)]:
        return (
            "the blocks go round the wrong way: a rank sends its block to the next rank (r + 1 mod cp) and "
            "receives the previous rank's (r - 1), so that after s passes it holds rank (r - s mod cp)'s block"
        )
    for d in (1, -1):
        if t == [e[(j + d) % n] for j in range(n)]:
            return (
                f"the owner of the block in hand is off by {d:+d}: after s passes a rank holds the block of rank "
                f"(r - s) mod cp (each pass brings the previous rank's), not of rank (r - s {'+' if d > 0 else '-'}"
                " 1)"
            )
    wrong = [j for j in range(n) if t[j] != e[j]]
    if wrong == [(p + 1) % n] and t[wrong[0]] is None:
        return (
            "the last step is missing: cp steps attend cp blocks, and the block of rank r + 1 arrives with the "
            "last of the cp - 1 passes"
        )
    causes = []
    if any(a == "all" and b == "causal" for a, b in zip(t, e)):
        causes.append("the diagonal block needs the causal mask (a query sees only the keys at or before it)")
    if any(a == "causal" and b == "all" for a, b in zip(t, e)):
        causes.append(
            "the causal mask is for the diagonal block only: an earlier rank's keys all come before this rank's queries"
        )
    if any(a is not None and b is None for a, b in zip(t, e)):
        causes.append("under the causal mask a later rank's block is not attended at all")
    if any(a is None and b is not None for a, b in zip(t, e)):
        causes.append("every block this rank's queries see must be attended once")
    return "; ".join(causes)


def forward_mistake(whole: dict, p: int, got_out, got_lse, where: str, atol: float) -> str:
    """Why position p's (out, lse) is wrong: the blocks it attended wrongly, when some combination of whole blocks
    (each with the causal mask, without it, or not at all) gives what it returned; else the numbers."""
    n, length, ring = len(whole["ring"]), whole["length"], whole["ring"]
    rows = slice(p * length, (p + 1) * length)
    expected = expected_treatments(p, n, whole["causal"])
    right = {name: whole[name][:, :, rows] for name in ("out", "lse")}
    if _close(got_out, right["out"], atol):
        return (
            f"{where}: out is right, lse is not (" + _differs("lse", got_lse, right["lse"], atol) + "): return the "
            "merged lse, the log of each query's normaliser over every key it sees (the backward needs it)"
        )
    for t in itertools.product(TREATMENTS, repeat=n):
        if list(t) == expected or all(x is None for x in t):
            continue
        out, lse = attention(whole["q"][:, :, rows], whole["k"], whole["v"], _seen(t, length))
        if _close(got_out, out, atol) and _close(got_lse, lse, atol):
            return (
                f"{where}: its output is attention with {_said(t, expected, p, ring)}. Likely: "
                f"{_likely(t, expected, p, n)}"
            )
    return (
        f"{where}: " + _differs("out", got_out, right["out"], atol) + "; it is no combination of whole blocks "
        "(each attended with the causal mask, without it, or not at all): is the merge right (its own check), "
        "and is each block merged exactly once?"
    )


# --- the rings' gradients ------------------------------------------------------------------------------------
def _shares(whole: dict) -> dict:
    """{(r, j, treatment): (dq, dk, dv)}: position r's queries' share of the gradients through block j."""
    n, length = len(whole["ring"]), whole["length"]
    rows = [slice(p * length, (p + 1) * length) for p in range(n)]
    part = {name: [whole[name][:, :, s] for s in rows] for name in ("grad", "q", "k", "v", "out", "lse")}
    return {
        (r, j, t): kernel.plain_attend_backward(
            part["grad"][r],
            part["q"][r],
            part["k"][j],
            part["v"][j],
            part["out"][r],
            part["lse"][r],
            t == "causal",
            None,
        )
        for r in range(n)
        for j in range(n)
        for t in ("all", "causal")
    }


def dq_mistake(whole: dict, p: int, got_dq, where: str, atol: float) -> str:
    n, length = len(whole["ring"]), whole["length"]
    shares, expected = _shares(whole), expected_treatments(p, n, whole["causal"])
    for t in itertools.product(TREATMENTS, repeat=n):
        if list(t) == expected:
            continue
        dq = sum((shares[(p, j, x)][0] for j, x in enumerate(t) if x is not None), torch.zeros_like(got_dq))
        if _close(got_dq, dq, atol):
            return (
                f"{where}: dq is the gradient through {_said(t, expected, p, whole['ring'])}. Likely: "
                f"{_likely(t, expected, p, n)}"
            )
    return f"{where}: " + _differs("dq", got_dq, whole["dq"][:, :, p * length : (p + 1) * length], atol)


def dkv_mistake(whole: dict, p: int, got_dk, got_dv, where: str, atol: float) -> str:
    """Why position p's dk, dv are wrong: some block's gradient from the queries of only some ranks, when it is."""
    n, length, ring = len(whole["ring"]), whole["length"], whole["ring"]
    shares = _shares(whole)
    sees = {j: [r for r in range(n) if expected_treatments(r, n, whole["causal"])[j] is not None] for j in range(n)}
    for j in range(n):
        for size in range(len(sees[j]) + 1):
            for some in itertools.combinations(sees[j], size):
                parts = [shares[(r, j, expected_treatments(r, n, whole["causal"])[j])] for r in some]
                dk = sum((s[1] for s in parts), torch.zeros_like(got_dk))
                dv = sum((s[2] for s in parts), torch.zeros_like(got_dv))
                if (j, list(some)) == (p, sees[p]) or not (_close(got_dk, dk, atol) and _close(got_dv, dv, atol)):
                    continue
                ranks = [ring[r] for r in some]
                if j != p:
                    return (
                        f"{where}: dk and dv are the gradient of rank {ring[j]}'s keys and values (from the "
                        f"queries of ranks {ranks}), not of its own: a block's gradient belongs to its owner; it "
                        "travels one pass behind its block, and the last pass brings it home"
                    )
                missing = [ring[r] for r in sees[p] if r not in some]
                return (
                    f"{where}: dk and dv hold the shares of the queries of ranks {ranks} only; those of ranks "
                    f"{missing} are missing. Each rank adds its share to the gradient that arrives with the block "
                    "and passes the sum on; the owner adds its own share when the gradient comes home"
                )
    rows = slice(p * length, (p + 1) * length)
    name = "dk" if not _close(got_dk, whole["dk"][:, :, rows], atol) else "dv"
    return f"{where}: " + _differs(name, {"dk": got_dk, "dv": got_dv}[name], whole[name][:, :, rows], atol)


# --- the traffic ---------------------------------------------------------------------------------------------
def traffic_mistake(messages: list, r: int, n: int, block: int, direction: str) -> str | None:
    """What is wrong with the messages rank r posted in one ring (`block`: the values of one block of K and V)."""
    following, previous = (r + 1) % n, (r - 1) % n
    strays = sorted(
        {(kind, peer) for kind, peer, _ in messages if (kind, peer) not in (("send", following), ("recv", previous))}
    )
    if strays:
        if n > 2 and set(strays) >= {("send", previous), ("recv", following)}:
            return (
                f"rank {r} sends to rank {previous} and receives from rank {following}: the blocks go round the "
                "wrong way. A rank sends to the next rank (r + 1 mod cp) and receives from the previous one "
                "(r - 1 mod cp), so that after s passes it holds rank (r - s mod cp)'s block"
            )
        return (
            f"rank {r} (previous rank {previous}, next rank {following}) also posted "
            + ", ".join(f"a {'send to' if kind == 'send' else 'receive from'} rank {peer}" for kind, peer in strays)
            + ": in the ring a rank sends only to the next rank and receives only from the previous one"
        )
    passes = n - 1 if direction == "forward" else 2 * (n - 1)
    carried = (
        "cp - 1 blocks of K and V"
        if direction == "forward"
        else "cp - 1 blocks of K and V and cp - 1 of their gradients, dK and dV"
    )
    for kind, verb in (("send", "sent"), ("recv", "received")):
        amount = sum(elements for k, _, elements in messages if k == kind)
        if amount == passes * block:
            continue
        why = ""
        if direction == "forward" and amount > passes * block:
            why = ": after cp - 1 passes every block has visited every rank, so the last step passes nothing on"
        elif direction == "forward":
            why = ": a block that does not go all the way round is not attended by every rank (a pass missing?)"
        elif amount == (passes + 1) * block:
            why = (
                ": one block too many. A rank's share of its own block stays at home: the gradient of a block needs "
                "cp - 1 passes to collect every other rank's share and reach its owner"
            )
        return (
            f"the {direction} ring: rank {r} {verb} {amount} values ({amount / block:g} blocks of {block} values); "
            f"it must {'send' if kind == 'send' else 'receive'} {carried}, {passes * block} values{why}"
        )
    return None


# --- the order of events -------------------------------------------------------------------------------------
def overlap_mistake(events: list, r: int) -> str | None:
    """Whether rank r's record (tasks.Recorded) shows every message waited for, and every pass that has a block's
    attention after it hidden behind one: posted before it, waited for after it."""
    split = next((i for i, e in enumerate(events) if e[0] == "phase"), len(events))
    first_wait = {}
    for i, (kind, index, _) in enumerate(events):
        if kind == "wait" and isinstance(index, int):
            first_wait.setdefault(index, i)
    for direction, span, given in (
        ("forward", range(split), "attend"),
        ("backward", range(split, len(events)), "attend_backward"),
    ):
        attends = [i for i in span if events[i][0] == "attend"]
        if not attends:
            return (
                f"rank {r} attended no block in the {direction} through the given {given}: the grader reads "
                "from it when each block's attention ran, against your messages"
            )
        for i in span:
            kind, peer, _ = events[i]
            if kind not in ("send", "recv"):
                continue
            what = f"its {'send to' if kind == 'send' else 'receive from'} rank {peer}"
            waited = first_wait.get(i)
            if waited is None:
                return (
                    f"rank {r}, {direction}: {what} was never waited for: wait for every message (a receive "
                    "before its block is used, a send before its buffer is reused)"
                )
            if i < attends[-1] and not any(i < a < waited for a in attends):
                done = sum(a < i for a in attends)
                return (
                    f"rank {r}, {direction}: {what}, posted after {done} block(s) had been attended, was waited "
                    "for before the next block's attention began: nothing ran while it travelled. Post the next "
                    "block's send and receive, attend the block you hold, and only then wait"
                )
    return None
