"""Lab 10 (the cost model) through the grader: the untouched skeleton scores 0, the reference full marks, the
toolkit's own cost model scores 0, and classic mistakes lose the checks that describe them. The released checks
hold no answer (steps.json holds inputs only, and the released judges test properties), so a model that is right
in structure but wrong in its counts passes them and fails the hidden checks, whose instructor's message names
the mistake, in units."""

import functools
import json
import math

import pytest
import torch
from lab_grading import LabGrading, check_named, verdict

from toolkit.grading import sibling
from toolkit.memory.formulas import alpha_beta_time
from toolkit.sim.timeline import schedule

CHECKS = {  # a short key -> the start of the check's name in checks.py
    "ring": "the ring's collectives:",
    "breakdown": "step_time's breakdown",
    "extremes": "step_time where the rule",
    "drawn_ring": "the ring's three collectives on cases drawn",
    "hand": "step_time on the six hand",
    "recorded": "step_time on the recorded",
    "whole": "your whole model",
}
LAB = LabGrading("10-cost-model", 14, CHECKS)  # 8 public points, 6 hidden


@pytest.mark.timeout(300)
def test_untouched_skeleton_scores_zero(no_leftover_ranks):
    LAB.assert_skeleton_scores_zero()


@pytest.mark.timeout(300)
def test_reference_solution_scores_full_marks(no_leftover_ranks):
    LAB.assert_reference_scores_full()


def test_the_toolkits_own_cost_model_scores_zero(tmp_path):
    LAB.assert_delegation_scores_zero(
        "from toolkit.memory.formulas import alpha_beta_time  # noqa: F401",
        "toolkit.memory.formulas:alpha_beta_time",
        tmp_path,
    )


@pytest.mark.timeout(300)
def test_collectives_that_run_at_once_lose_the_overlap_checks_and_are_named(tmp_path, no_leftover_ranks):
    """A collective that starts when issued, even while the previous one still holds the link."""
    LAB.assert_mistake_loses_exactly(
        "collectives run at once",
        ("start = max(clock, link_free)", "start = clock"),
        {
            "extremes": "did collectives run at once",
            "hand": "you let collectives run at once",
            "recorded": "you let collectives run at once",
            "whole": "your model predicts",
        },
        tmp_path,
    )


def _ring_answer(formulas: dict):
    """The ring's times, `formulas[op]` for the ops it names and the toolkit's own for the others."""

    def answer(r, case, given):
        return {
            call: formulas.get(op, functools.partial(alpha_beta_time, op))(size, n, alpha, beta)
            for call, (op, size, n, alpha, beta) in given[0]["calls"].items()
        }

    return answer


ONE_HALF = {"all_reduce": lambda s, n, a, b: (n - 1) * (a + s / n * b)}
WRONG_ALL_REDUCE = {  # the mistake's phrase in the hidden check's message -> the all-reduce's time it computes
    "you counted one half": ONE_HALF["all_reduce"],
    "you paid the latency once": lambda s, n, a, b: a + 2 * (n - 1) * s / n * b,
    "you sent the whole buffer at every step": lambda s, n, a, b: 2 * (n - 1) * (a + s * b),
}
WRONG_HALVES = {
    "you counted an all-reduce's 2(N-1) steps": lambda s, n, a, b: 2 * (n - 1) * (a + s / n * b),
    "you paid the latency once": lambda s, n, a, b: a + (n - 1) * s / n * b,
    "you sent the whole buffer at every step": lambda s, n, a, b: (n - 1) * (a + s * b),
    "you counted one step too many": lambda s, n, a, b: n * (a + s / n * b),
}


def _hidden_ring_message(op, formula) -> str:
    check = check_named(LAB.lab, "the ring's three collectives on cases drawn")
    return verdict(check, 1, _ring_answer({op: formula}))


@pytest.mark.parametrize("phrase", list(WRONG_ALL_REDUCE))
def test_all_reduce_mistakes_are_named_in_units_by_the_hidden_check(phrase):
    message = _hidden_ring_message("all_reduce", WRONG_ALL_REDUCE[phrase])
    assert phrase in message and message.startswith("all_reduce of "), message
    assert "world size" not in message and "e-0" not in message, message  # units, not float reprs


@pytest.mark.parametrize("op", ["reduce_scatter", "all_gather"])
@pytest.mark.parametrize("phrase", list(WRONG_HALVES))
def test_reduce_scatter_and_all_gather_mistakes_are_named_by_the_hidden_check(phrase, op):
    message = _hidden_ring_message(op, WRONG_HALVES[phrase])
    assert message.startswith(f"{op} of") and phrase in message, message


VISIBLE = {  # a mistake -> (what it computes, the phrase of the released check that catches it by a property)
    "one half for the all-reduce": (ONE_HALF, "did you count one half"),
    "the whole buffer at every step": (
        {op: WRONG_HALVES["you sent the whole buffer at every step"] for op in ("reduce_scatter", "all_gather")},
        "less than the buffer",
    ),
    "one step too many": (
        {op: WRONG_HALVES["you counted one step too many"] for op in ("reduce_scatter", "all_gather")},
        "one step too many",
    ),
    "the latency as bytes": (
        {"reduce_scatter": lambda s, n, a, b: (n - 1) * (a * s / n + s / n * b)},
        "the latency term counts messages, not bytes",
    ),
    "a group of one pays": ({"all_gather": lambda s, n, a, b: (n - 1 or 1) * (a + s / n * b)}, "moves nothing"),
}


@pytest.mark.parametrize("mistake", list(VISIBLE))
def test_the_released_check_catches_a_wrong_ring_by_its_structure(mistake):
    formulas, phrase = VISIBLE[mistake]
    check = check_named(LAB.lab, "the ring's collectives:")
    assert verdict(check, 1, _ring_answer({})) == ""  # the toolkit's own model passes
    assert phrase in verdict(check, 1, _ring_answer(formulas))


def test_latency_paid_once_passes_the_released_checks_and_fails_the_hidden_one():
    """What the properties cannot tell (how many alphas a ring pays) only the hidden check can."""

    def half(s, n, a, b):
        return 0.0 if n == 1 else WRONG_HALVES["you paid the latency once"](s, n, a, b)

    once = {"reduce_scatter": half, "all_gather": half, "all_reduce": lambda s, n, a, b: 2 * half(s, n, a, b)}
    assert verdict(check_named(LAB.lab, "the ring's collectives:"), 1, _ring_answer(once)) == ""
    message = verdict(check_named(LAB.lab, "the ring's three collectives on cases drawn"), 1, _ring_answer(once))
    assert ", expected " in message and message.split(" of ")[0] in ("all_reduce", "reduce_scatter", "all_gather")


class _Cost:
    def __init__(self, seconds, resources=("link",)):
        self.seconds, self.resources = seconds, resources


def _step_answer(*, queue=True, unwaited_ends=True, only=None):
    """step_time through the toolkit's schedule, or one of two classic mistakes (on the case `only`, if given)."""
    tasks = sibling(str(LAB.lab / "checks.py"), "tasks.py")

    def answer(r, case, given):
        program = tasks.decode(given[0]["program"])
        compute, comm = tasks.durations(program, given[0]["compute_s"], given[0]["comm_s"])
        wrong = only is None or case == only
        timeline = schedule(program, compute, lambda c: _Cost(comm(c), ("link",) if queue or not wrong else ()))
        found = timeline.breakdown()
        if not unwaited_ends and wrong:  # the step ends with the compute stream
            step = max([s.end for s in timeline.spans if s.kind == "compute"], default=0.0)
            found = dict(
                found,
                step=step,
                exposed_comm=step - found["compute"],
                overlapped_comm=found["overlapped_comm"] + found["exposed_comm"] - (step - found["compute"]),
            )
        return {"breakdown": found}

    return answer


def test_the_overlap_rule_passes_the_released_checks():
    for prefix in (
        "step_time's breakdown",
        "step_time where the rule",
        "step_time on the six hand",
        "step_time on the recorded",
    ):
        assert verdict(check_named(LAB.lab, prefix), 1, _step_answer()) == "", prefix


def test_a_missing_final_wait_is_named_as_such_not_as_never_stalling():
    unwaited = "a collective nobody waits for still ends the step"
    message = verdict(
        check_named(LAB.lab, "step_time on the six hand"), 1, _step_answer(unwaited_ends=False, only=unwaited)
    )
    assert message.startswith("a collective nobody waits for still ends the step: step = "), message
    assert "a collective still running (one nobody waits for) holds the step open" in message
    assert "never stalled" not in message
    released = verdict(check_named(LAB.lab, "step_time where the rule"), 1, _step_answer(unwaited_ends=False))
    assert "a collective nobody waits for still ends the step" in released, released


def test_collectives_at_once_are_caught_by_the_released_extremes():
    message = verdict(check_named(LAB.lab, "step_time where the rule"), 1, _step_answer(queue=False))
    assert "collectives take turns" in message, message


def test_the_released_files_hold_inputs_only():
    """steps.json holds what record_steps.py records from the toolkit's own strategies (the programs and their
    durations, run it again after a change), and no expected value, no classic mistake's value."""
    record = sibling(str(LAB.lab / "checks.py"), "record_steps.py")
    stored = json.loads((LAB.lab / "steps.json").read_text())
    fresh = record.durations_of(json.loads(json.dumps(stored)))
    assert json.dumps(fresh, sort_keys=True) == json.dumps(stored, sort_keys=True)
    text = json.dumps(stored)
    for word in ("expected", "mistakes", "exposed_comm", "overlapped_comm", '"step"'):
        assert word not in text, word
    drawn = check_named(LAB.lab, "step_time on the recorded").make_inputs(1, torch.Generator().manual_seed(0))
    assert all(math.isfinite(s) for case in drawn.ids for s in drawn.given(case)[0]["comm_s"].values())
