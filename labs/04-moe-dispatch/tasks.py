"""What every rank runs for lab 04's checks, next to your code: your pieces (and your LabMoE) on the tokens
the grader sent this rank, and what came out (counts, orders, rows, outputs, gradients, the recorded
all-to-alls). The grader's process computes the right answers and judges (checks.py)."""

import torch

from toolkit.moe import TopKGate
from toolkit.moe.experts import WEIGHTS, Experts
from toolkit.trace.events import recorder

D, FF, SEED, INIT = 8, 16, 7, 0.3


def skewed(layer):
    """Every token's scores put the last expert first and expert 0 second (feature 0 is set to 1)."""
    with torch.no_grad():
        E = layer.num_experts
        scores = -0.1 * torch.arange(1, E + 1, dtype=torch.float32)
        scores[E - 1], scores[0] = 2.0, 1.0
        layer.gate.router.weight.zero_()
        layer.gate.router.weight[:, 0] = scores
    return layer


def gate_of(case):
    torch.manual_seed(case["gate_seed"])
    return TopKGate(D, case["E"], case["k"], case["factor"])


def kept_order(routing, k):
    """The kept choices (flat index t*k + j) grouped by expert: what combine receives its answers in."""
    choices = [
        (int(routing.expert_index.reshape(-1)[c]), c)
        for c in range(routing.kept.numel())
        if bool(routing.kept.reshape(-1)[c])
    ]
    return torch.tensor([c for _, c in sorted(choices)], dtype=torch.long)


def counts(student, rank, given):
    send, recv = student.exchange_counts(given["kept"].clone(), rank.world_size, given["per_rank"], rank.group)
    return {"send": send, "recv": recv}


def sort(student, rank, given):
    routing = gate_of(given)(given["tokens"])
    order, rows = student.sort_by_destination(given["tokens"], routing)
    return {"order": order, "rows": rows}


def all_to_all(student, rank, given):
    x = given["rows"].clone().requires_grad_(True)
    out = student.all_to_all(x, given["out_splits"], given["in_splits"], rank.group, "lab")
    (out * given["probe"]).sum().backward()
    return {"out": out.detach(), "grad": x.grad}


def local_experts(student, rank, given):
    experts = Experts(D, FF, 3 * rank.world_size, 3 * rank.rank, 3, seed=SEED, init_std=INIT)
    with torch.no_grad():
        return {"out": student.compute_experts(experts, given["received"], given["recv"])}


def weighted_sum(student, rank, given):
    gate = gate_of(given)
    routing = gate(given["tokens"])
    order = kept_order(routing, given["k"])
    answers = given["answers"][: len(order)].clone().requires_grad_(True)
    out = student.combine(answers, routing, order, given["tokens"].shape[0])
    (out * given["probe"]).sum().backward()
    return {"out": out.detach(), "answers_grad": answers.grad, "router_grad": gate.router.weight.grad is not None}


def layer(student, rank, given):
    """Your LabMoE on this rank's tokens, in one configuration: output, gradients, the choices dropped."""
    moe = student.LabMoE(D, FF, group=rank.group, seed=SEED, init_std=INIT, name="lab", **given["options"])
    if given["skew"]:
        skewed(moe)
    x = given["x"].clone().requires_grad_(True)
    out, aux = moe(x)
    found = {"out": out.detach() if isinstance(out, torch.Tensor) else out}
    if isinstance(out, torch.Tensor) and out.shape == x.shape:
        ((out * given["probe"]).sum() + aux).backward()
        found.update(
            x_grad=x.grad,
            grads={w: getattr(moe.experts, w).grad for w in WEIGHTS},
            dropped=recorder.metrics[-1]["value"]["dropped"] if recorder.metrics else None,
        )
    return found


def trace(student, rank, given):
    """The collectives of one forward and backward, as the grader's relay carried them (a mark it fills in), and
    the labels send_rows put on this rank's own trace (the rank's word: no relay sees a label)."""
    moe = student.LabMoE(D, FF, 2 * rank.world_size, top_k=2, group=rank.group, seed=SEED, init_std=INIT)
    start, labelled = rank.events_now(), rank.local_now()
    out, aux = moe(given["x"].clone().requires_grad_(True))
    ((out * given["probe"]).sum() + aux).backward()
    labels = [e["args"].get("moe") for e in rank.local_events(labelled) if e["name"] == "all_to_all"]
    return {"calls": rank.comm_events(start), "labels": labels}
