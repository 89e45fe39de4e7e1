"""What every rank runs for lab 12's checks, next to your code: your `one_f_one_b` on the layouts the grader
sent, and the toolkit's pipeline driver running your lists on real ranks (a tiny GPT trained from the seed and
batches the grader sent). Nothing here knows the right answer: the grader's process judges what these return
(checks.py): your lists as data, the losses and weights the pipeline trained, the actions each rank ran."""

import torch

import toolkit
from toolkit.models import tiny_gpt
from toolkit.parallel.pipeline import PipelineDeadlock
from toolkit.trace.events import recorder

MODEL = dict(n_layer=12, d_model=16, n_head=2)  # 12 blocks: 6, 4 or 3 per stage at pp = 2, 3, 4


def lists(student, rank, given):
    """Every rank's list at one layout (pp, microbatches), as your function returns it: read, not run."""
    pp, m = given["pp"], given["microbatches"]
    return {call(pp, m, r): student.one_f_one_b(pp, m, r) for r in range(pp)}


def call(pp, m, r) -> str:
    return f"one_f_one_b({pp}, {m}, {r})"


def real_ranks(student, rank, given):
    """Your lists run by the toolkit's driver on world-size ranks (one stage each): two SGD steps."""
    pp, m = rank.world_size, given["microbatches"]
    torch.manual_seed(given["seed"])
    sgd = lambda params: torch.optim.SGD(params, **given["optimizer"])  # noqa: E731
    try:
        model, opt = toolkit.parallel.wrap(
            tiny_gpt(**MODEL), "local", optimizer=sgd, pp=pp, microbatches=m, schedule=student.one_f_one_b
        )
    except PipelineDeadlock as exc:  # the driver's dry run, before anything runs
        return {"refused": str(exc)}
    losses, start = [], rank.local_now()  # where the trace of what ran starts (the rank's own record)
    for x, y in given["batches"]:
        losses.append(model.forward_backward(x, y).detach())
        opt.step()
        opt.zero_grad()
    last = len(given["batches"]) - 1
    ran = [
        [e["args"]["action"], e["args"]["micro"], e["args"]["stage"]]
        for e in recorder.events[start:]
        if e["cat"] == "compute" and "action" in e["args"] and e["args"]["step"] == last
    ]
    state = toolkit.parallel.full_state_dict(model)  # every rank takes part; rank 0 sends it
    return {
        "losses": losses,
        "ran": ran,
        "listed": student.one_f_one_b(pp, m, rank.rank),
        "state": state if rank.rank == 0 else None,
    }
