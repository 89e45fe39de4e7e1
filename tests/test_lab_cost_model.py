"""Lab 10 (the cost model) through the grader: the untouched skeleton scores 0, the reference full marks, the
toolkit's own cost model scores 0, and classic mistakes lose exactly the checks that describe them, with a
message that names the mistake (in units, never a float's repr, and never "world size 1" for a case of 512
ranks). The released checks hold numbers only; steps.json's numbers are the toolkit's own, recomputed here."""
import json

import pytest
import torch
from lab_grading import LabGrading

from toolkit.grading import CheckFailed, Judge, lab_checks, sibling
from toolkit.memory.formulas import alpha_beta_time

CHECKS = {  # a short key -> the start of the check's name in checks.py
    "all_reduce": "all_reduce_time",
    "rs_ag": "reduce_scatter_time and all_gather_time",
    "hand": "step_time on six hand cases",
    "recorded": "step_time on steps recorded",
    "whole": "your whole model",
    "drawn_ring": "the ring's three collectives on cases drawn",
    "drawn_steps": "step_time on the recorded programs with durations drawn",
}
LAB = LabGrading("10-cost-model", 14, CHECKS)  # 11 public points, 3 hidden


@pytest.mark.timeout(300)
def test_untouched_skeleton_scores_zero(no_leftover_ranks):
    LAB.assert_skeleton_scores_zero()


@pytest.mark.timeout(300)
def test_reference_solution_scores_full_marks(no_leftover_ranks):
    LAB.assert_reference_scores_full()


def test_the_toolkits_own_cost_model_scores_zero(tmp_path):
    LAB.assert_delegation_scores_zero("from toolkit.memory.formulas import alpha_beta_time  # noqa: F401",
                                      "toolkit.memory.formulas:alpha_beta_time", tmp_path)


@pytest.mark.timeout(300)
def test_collectives_that_run_at_once_lose_the_overlap_checks_and_are_named(tmp_path, no_leftover_ranks):
    """A collective that starts when issued, even while the previous one still holds the link."""
    LAB.assert_mistake_loses_exactly("collectives run at once", ("start = max(clock, link_free)", "start = clock"),
                                     {"hand": "you let collectives run at once", "recorded": "expected",
                                      "whole": "your model predicts", "drawn_steps": "the overlap rule is wrong"},
                                     tmp_path)


def _judge(prefix: str, got) -> str:
    (check,) = [c for c in lab_checks(LAB.lab)[0] if c.name.startswith(prefix)]
    given = check.make_inputs(1, torch.Generator().manual_seed(0))
    with pytest.raises(CheckFailed) as failure:
        check.judge(Judge(1), given, [got(given[0])])
    return str(failure.value)


WRONG_ALL_REDUCE = {
    "you counted one half": lambda s, n, a, b: (n - 1) * (a + s / n * b),
    "you paid the latency once": lambda s, n, a, b: a + 2 * (n - 1) * s / n * b,
    "you sent the whole buffer at every step": lambda s, n, a, b: 2 * (n - 1) * (a + s * b),
}
WRONG_HALVES = {
    "you counted an all-reduce's 2(N-1) steps": lambda s, n, a, b: 2 * (n - 1) * (a + s / n * b),
    "you paid the latency once": lambda s, n, a, b: a + (n - 1) * s / n * b,
    "you sent the whole buffer at every step": lambda s, n, a, b: (n - 1) * (a + s * b),
    "you counted one step too many": lambda s, n, a, b: n * (a + s / n * b),
}


@pytest.mark.parametrize("phrase", list(WRONG_ALL_REDUCE))
def test_all_reduce_mistakes_are_named_in_units(phrase):
    formula = WRONG_ALL_REDUCE[phrase]
    message = _judge("all_reduce_time", lambda given: {"values": [formula(*case[1:]) for case in given["cases"]]})
    assert phrase in message and message.startswith("all_reduce of 1.02 kB over 2 ranks"), message
    assert "world size" not in message and "e-0" not in message, message  # units, not float reprs


@pytest.mark.parametrize("op", ["reduce_scatter", "all_gather"])
@pytest.mark.parametrize("phrase", list(WRONG_HALVES))
def test_reduce_scatter_and_all_gather_mistakes_are_named(phrase, op):
    formula = WRONG_HALVES[phrase]

    def got(given):  # right for the other collective, wrong for this one
        return {"values": [formula(*c[1:]) if c[0] == op else alpha_beta_time(*c) for c in given["cases"]]}

    message = _judge("reduce_scatter_time and all_gather_time", got)
    assert message.startswith(f"{op} of") and phrase in message, message


def _step(step: float):
    return {"step": step, "compute": 0.0, "exposed_comm": 0.0, "overlapped_comm": 0.0}


def test_a_missing_final_wait_is_named_as_such_not_as_never_stalling():
    data = json.loads((LAB.lab / "steps.json").read_text())
    hand = list(data["hand"])

    def ignores_the_unwaited(given):  # right everywhere, except that the step ends with the compute stream
        return {"breakdowns": [data["hand"][name]["expected"] if name != "a collective nobody waits for still ends "
                               "the step" else _step(1.0) for name in hand]}

    message = _judge("step_time on six hand cases", ignores_the_unwaited)
    assert message.startswith("a collective nobody waits for still ends the step: step = 1 s, expected 3 s")
    assert "a collective still running (one nobody waits for) holds the step open" in message
    assert "never stalled" not in message


def test_charging_every_collective_as_blocking_is_named():
    data = json.loads((LAB.lab / "steps.json").read_text())
    blocking = {"breakdowns": [dict(want["expected"], step=want["mistakes"].get("blocking", want["expected"]["step"]))
                               for want in data["hand"].values()]}
    message = _judge("step_time on six hand cases", lambda given: blocking)
    assert "as if it blocked" in message, message


def test_the_released_numbers_are_the_toolkits():
    """steps.json holds what record_steps.py computes from the toolkit's own cost model (run it again after a
    change); the recorded durations too, so a student's grade depends on nothing else."""
    record = sibling(str(LAB.lab / "checks.py"), "record_steps.py")
    stored = json.loads((LAB.lab / "steps.json").read_text())
    fresh = record.expected(json.loads(json.dumps(stored)))
    assert json.dumps(fresh, sort_keys=True) == json.dumps(stored, sort_keys=True)
