"""What every rank runs for lab 01's checks, next to your code: it calls your functions on the inputs the
grader sent this rank and returns what came out. Nothing here knows the right answer: the grader's
process judges what these return (checks.py)."""

import torch
import torch.distributed as dist

import toolkit

OPS = {"SUM": dist.ReduceOp.SUM, "MAX": dist.ReduceOp.MAX, "MIN": dist.ReduceOp.MIN, "PRODUCT": dist.ReduceOp.PRODUCT}


def _all_reduce(student, case, group):
    x = case["x"].clone()
    student.all_reduce(x, OPS[case["op"]], group, False)
    return x


def all_gather(student, rank, given):
    x = given["x"]
    output = torch.full((rank.world_size * x.shape[0], x.shape[1]), float("nan"))
    student.all_gather(output, x, rank.group, False)
    return {"output": output}


def reduce_scatter(student, rank, given):
    mine = given["x"].clone()
    output = torch.full((mine.numel() // rank.world_size,), float("nan"))
    student.reduce_scatter(output, mine, OPS["SUM"], rank.group, False)
    return {"output": output, "input_after": mine}


def all_reduce(student, rank, given):
    return {"x": _all_reduce(student, given, rank.group)}


def ring_traffic(student, rank, given):
    with rank.messages() as messages:
        x = _all_reduce(student, given, rank.group)
    return {"x": x, "messages": messages}


def subgroups(student, rank, given):
    pair, _ = dist.new_subgroups_by_enumeration(given["pairs"])
    alone, _ = dist.new_subgroups_by_enumeration([[r] for r in range(rank.world_size)])
    return {"pair": _all_reduce(student, given["pair"], pair), "alone": _all_reduce(student, given["alone"], alone)}


def through_the_door(student, rank, given):
    from toolkit.trace.events import recorder

    x = given["x"].clone()
    toolkit.comm.use(
        {"all_reduce": student.all_reduce, "reduce_scatter": student.reduce_scatter, "all_gather": student.all_gather}
    )
    try:
        toolkit.comm.all_reduce(x, op="avg", group=rank.group)
    finally:
        toolkit.comm.use("backend")
    return {"x": x, "impl": recorder.events[-1]["args"]["impl"]}
