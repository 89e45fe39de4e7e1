"""What every rank runs for lab 09's checks, next to your code: your split and your pipelined experts on the
tokens and expert weights the grader sent this rank, and what happened (chunk sizes, outputs, gradients, the
recorded exchanges and expert spans with their times). The grader's process judges (checks.py)."""

import torch

from toolkit.trace.events import recorder


def _events(start) -> list:
    keep = ("name", "cat", "start", "end")
    return [dict({k: e.get(k) for k in keep}, args=dict(e.get("args", {}))) for e in recorder.events[start:]]


def run(student, rank, given, degree, backward=False) -> dict:
    """Your pipeline on this rank at one degree: output (and input and weight gradients), the trace."""
    start = len(recorder.events)
    experts = student.Experts(given["w1"].clone(), given["w2"].clone())
    x = given["x"].clone().requires_grad_(backward)
    out = student.pipelined_experts(x, degree, experts, rank.group)
    found = {"out": out.detach()}
    if backward:
        (out * given["probe"]).sum().backward()
        found.update(x_grad=x.grad, w1_grad=experts.w1.grad, w2_grad=experts.w2.grad)
    found["events"] = _events(start)
    return found


def split(student, rank, given):
    x = torch.arange(2 * 5 * 3.0).view(2, 5, 3)
    if given["degree"] == 0:
        try:
            student.split_capacity(x, 0)
        except ValueError:
            return {"raised": "ValueError"}
        return {"raised": "nothing"}
    return {"chunks": list(student.split_capacity(x, given["degree"]))}


def outputs(student, rank, given):
    return run(student, rank, given, given["degree"])


def gradients(student, rank, given):
    return run(student, rank, given, given["degree"], backward=True)


def traffic(student, rank, given):
    """The same tokens through your pipeline at each degree: one forward each."""
    return {f"degree {degree}": run(student, rank, given, degree) for degree in given["degrees"]}
