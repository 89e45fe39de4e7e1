"""What the rank runs for lab 10's checks, next to your code: your four functions on the cases the grader sent
(numbers in, numbers out), and what they returned. The grader's process judges (checks.py)."""
from toolkit.sim.program import Collective, Compute, Wait

KINDS = {"compute": Compute, "collective": Collective, "wait": Wait}


def decode(instructions) -> list:
    """A program from its JSON form (a list of dicts, each with a "kind")."""
    program = []
    for item in instructions:
        fields = dict(item)
        kind = KINDS[fields.pop("kind")]
        if kind is Collective:
            fields["group"] = tuple(fields["group"])
        program.append(kind(**fields))
    return program


def durations(program, compute_s: list, comm_s: dict):
    """(compute_seconds, comm_seconds), the two callables step_time is given: each instruction's duration,
    compute_s by its position in the program, comm_s by collective id."""
    by_object = {id(i): s for i, s in zip(program, compute_s) if isinstance(i, Compute)}
    return (lambda c: by_object[id(c)]), (lambda c: comm_s[str(c.id)])


def ring_times(student, rank, given):
    functions = {"all_reduce": student.all_reduce_time, "reduce_scatter": student.reduce_scatter_time,
                 "all_gather": student.all_gather_time}
    return {"values": [functions[op](size, n, alpha, beta) for op, size, n, alpha, beta in given["cases"]]}


def step_times(student, rank, given):
    found = []
    for case in given["cases"]:
        program = decode(case["program"])
        found.append(student.step_time(program, *durations(program, case["compute_s"], case["comm_s"])))
    return {"breakdowns": found}


def whole_model(student, rank, given):
    times = {"all_reduce": student.all_reduce_time, "reduce_scatter": student.reduce_scatter_time,
             "all_gather": student.all_gather_time}
    found = []
    for case in given["cases"]:
        program = decode(case["program"])
        compute, _ = durations(program, case["compute_s"], {})
        alpha, beta = case["alpha"], case["beta"]
        found.append(student.step_time(program, compute, lambda c: times[c.op](c.size_bytes, len(c.group), alpha,
                                                                              beta)))
    return {"breakdowns": found}
