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
    functions = {
        "all_reduce": student.all_reduce_time,
        "reduce_scatter": student.reduce_scatter_time,
        "all_gather": student.all_gather_time,
    }
    return {call: functions[op](size, n, alpha, beta) for call, (op, size, n, alpha, beta) in given["calls"].items()}


def step_times(student, rank, given):
    program = decode(given["program"])
    return {"breakdown": student.step_time(program, *durations(program, given["compute_s"], given["comm_s"]))}


def whole_model(student, rank, given):
    """Your collective times inside your overlap rule, on a recorded program with the grader's alpha and beta."""
    times = {
        "all_reduce": student.all_reduce_time,
        "reduce_scatter": student.reduce_scatter_time,
        "all_gather": student.all_gather_time,
    }
    program = decode(given["program"])
    compute, _ = durations(program, given["compute_s"], {})
    alpha, beta = given["alpha"], given["beta"]
    return {
        "breakdown": student.step_time(program, compute, lambda c: times[c.op](c.size_bytes, len(c.group), alpha, beta))
    }
