"""The contract between the cases a grader draws and what the ranks answer (toolkit/grading/contract.py), for any
lab: every case comes back exactly once, under its id, in order, of the declared type and shape, before any judge
runs; judges see only the grader's own copy of the inputs.

Proved on a toy lab written here (the framework was not written for it): short, long, reordered, repeated and
misshapen answers are refused, in-process and through a real grading whose submission tampers with its own copy of
the inputs from the frame that holds them. Then the attack that broke labs 04, 09, 10 and 12 (the emptied inputs,
lab 10's lookup table) is replayed on the labs themselves; the gradings of whole labs are under `grading_scale`
(make test-grading) but lab 12's, which takes one launch.
"""

import ast

import pytest
import torch
from lab_grading import EMPTY_THE_INPUTS, LABS, LabGrading

from toolkit.grading import (
    CheckFailed,
    ContractBroken,
    Either,
    Items,
    List,
    Maybe,
    Tensor,
    check,
    format_score,
    grade,
    lab_checks,
    like,
)
from toolkit.grading.contract import draw, observations

# --- the contract, in-process, on a check it was not written for ---------------------------------------------------
TOY = check(
    "the toy: a doubled vector and its length",
    points=1,
    world_sizes=(2,),
    cases=lambda n, g: {f"{k} elements": [{"x": torch.randn(k, generator=g)} for _ in range(n)] for k in (1, 3, 5)},
    returns=lambda case, r, n: {"y": like(case["x"]), "length": int},
)(lambda ctx, given, got: None)


def _drawn():
    return TOY.make_inputs(2, torch.Generator().manual_seed(0))


def _right(drawn):
    return [[[case, {"y": 2 * x["x"], "length": len(x["x"])}] for case, x in drawn[r]] for r in range(2)]


def _refused(drawn, sent) -> str:
    with pytest.raises(ContractBroken) as failure:
        observations(drawn, sent, TOY.returns)
    return str(failure.value)


def test_the_right_answers_pass_and_reach_the_judge_keyed_by_case():
    drawn, seen = _drawn(), []
    judged = check("the toy", world_sizes=(2,), cases=TOY.cases, returns=TOY.returns)(
        lambda ctx, given, got: seen.append((ctx.case, given, got))
    )
    judged.verdict(2, drawn, _right(drawn))
    assert [case for case, _, _ in seen] == ["1 elements", "3 elements", "5 elements"]
    for case, given, got in seen:
        assert given is drawn.given(case) and len(got) == 2  # the grader's own copy, one per rank
        assert torch.equal(got[1]["y"], 2 * given[1]["x"])


@pytest.mark.parametrize(
    "tamper, phrase",
    [
        (lambda sent: sent[1][:2], "rank 1 sent no observation for case '5 elements' of the 3 the grader drew"),
        (lambda sent: [], "rank 1 sent no observation for cases '1 elements', '3 elements', '5 elements'"),
        (
            lambda sent: sent[1] + [["7 elements", {"y": torch.zeros(7), "length": 7}]],
            "rank 1 sent observations for case '7 elements' that the grader never drew",
        ),
        (lambda sent: sent[1] + [sent[1][0]], "rank 1 sent case '1 elements' more than once"),
        (lambda sent: sent[1][::-1], "rank 1 sent the cases in another order"),
        (
            lambda sent: [[c, dict(o, y=torch.zeros(4))] for c, o in sent[1]],
            "rank 1, case '1 elements': y is a tensor of shape (4,) float32, expected a tensor of shape (1,) float32",
        ),
        (lambda sent: [[c, dict(o, y=o["y"].double())] for c, o in sent[1]], "y is a tensor of shape (1,) float64"),
        (lambda sent: [[c, dict(o, length=True)] for c, o in sent[1]], "length is a bool (True), expected an int"),
        (lambda sent: [[c, {"y": o["y"]}] for c, o in sent[1]], "lacks ['length']"),
        (lambda sent: [[c, dict(o, extra=1)] for c, o in sent[1]], "has keys nobody asked for ['extra']"),
        (lambda sent: [["1 elements"]], "instead of one [case id, observation] per case"),
        (lambda sent: {"1 elements": sent[1][0][1]}, "instead of one [case id, observation] per case"),
    ],
)
def test_a_short_long_reordered_repeated_or_misshapen_answer_is_refused_before_any_judge(tamper, phrase):
    drawn = _drawn()
    sent = _right(drawn)
    sent[1] = tamper(sent)
    called = []
    judged = check("the toy", world_sizes=(2,), cases=TOY.cases, returns=TOY.returns)(
        lambda ctx, given, got: called.append(ctx.case)
    )
    with pytest.raises(CheckFailed) as failure:
        judged.verdict(2, drawn, sent)
    assert phrase in str(failure.value), str(failure.value)
    assert called == [], "a judge ran on answers the contract refused"


def test_specs_say_what_is_wrong_in_a_students_words():
    spec = {"lists": List(Items(str, int, int, why="each action is Action(kind, micro, stage)"))}
    drawn = draw({"x": 1}, None, 1, torch.Generator())
    said = _refused_with(drawn, [[["", {"lists": [["F", 0, 0], ["B", "0", 0]]}]]], spec)
    assert said == "lists[1][1] is a str ('0'), expected an int", said
    said = _refused_with(drawn, [[["", {"lists": [["F", 0]]}]]], spec)
    assert said.endswith(
        "lists[0] is a list of 2 items, expected a list of 3: (a str, an int, an int): each action "
        "is Action(kind, micro, stage)"
    ), said
    assert (
        _refused_with(drawn, [[["", 5]]], Either({"a": int}, None))
        == "the observation is an int (5), expected a dict with keys 'a' or None"
    )
    assert observations(drawn, [[["", None]]], Maybe(Tensor((2,)))) == {"": [None]}


def _refused_with(drawn, sent, spec) -> str:
    with pytest.raises(ContractBroken) as failure:
        observations(drawn, sent, spec, pure=True)
    return str(failure.value)


# --- the same through a real grading, the submission tampering with its own inputs -------------------------------
TOY_TASKS = """
def doubled(student, rank, given):
    return {"y": student.double(given["x"]), "length": len(given["x"])}
"""
TOY_CHECKS = """
import torch
from toolkit.grading import check, like


def _cases(n, g):
    return {f"{k} elements": [{"x": torch.randn(k, generator=g)} for _ in range(n)] for k in (1, 3, 5)}


def judge(ctx, given, got):
    for r in range(ctx.world_size):
        ctx.expect(got[r]["y"], 2 * given[r]["x"], "the doubled vector", rank=r)


for _name in ("emptied", "shortened", "reordered", "repeated", "lengthened", "misshapen", "untouched"):
    globals()[_name] = check(_name, points=1, world_sizes=(2,), task="doubled", cases=_cases,
                             returns=lambda case, r, n: {"y": like(case["x"]), "length": int})(judge)
"""
TAMPERING = """
import sys
import torch


def double(x):
    return 2 * x


frame = sys._getframe(0)
while frame is not None and not isinstance(frame.f_locals.get("given"), dict):
    frame = frame.f_back
given = frame.f_locals["given"]  # {check index: [[case id, inputs], ...]}: this rank's copy of the inputs
cases = [given[str(k)] for k in range(7)]
cases[0].clear()                                             # emptied
del cases[1][-1]                                             # shortened
cases[2].reverse()                                           # reordered
cases[3].append(list(cases[3][0]))                           # repeated
cases[4].append(["7 elements", {"x": torch.zeros(7)}])       # lengthened
cases[5][0][1]["x"] = torch.zeros(9)                         # misshapen: its answer follows the inputs it was given
"""
TAMPERED = {
    "emptied": "sent no observation for cases '1 elements', '3 elements', '5 elements'",
    "shortened": "sent no observation for case '5 elements'",
    "reordered": "sent the cases in another order",
    "repeated": "sent case '1 elements' more than once",
    "lengthened": "sent observations for case '7 elements' that the grader never drew",
    "misshapen": "case '1 elements': y is a tensor of shape (9,) float32, expected a tensor of shape (1,)",
}


@pytest.mark.timeout(300)
def test_a_submission_that_tampers_with_its_inputs_scores_nothing_for_it(tmp_path, no_leftover_ranks):
    (tmp_path / "tasks.py").write_text(TOY_TASKS)
    (tmp_path / "checks.py").write_text(TOY_CHECKS)
    (tmp_path / "skeleton.py").write_text(TAMPERING)
    score = grade(tmp_path)
    results = {r.name: r for r in score.results}
    assert score.total == 1 and results["untouched"].passed, format_score(score)
    for name, phrase in TAMPERED.items():
        assert phrase in results[name].message and results[name].message.startswith("world size 2, rank "), (
            name,
            results[name].message,
        )


# --- the attacks that broke the labs, replayed ------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_lab12_skeleton_with_emptied_inputs_scores_zero(tmp_path, no_leftover_ranks):
    """Before the contract: 5/7 (every check zipped the drawn layouts with an emptied list)."""
    LabGrading("12-pipeline", 7, {}).assert_attack_scores(EMPTY_THE_INPUTS, 0, tmp_path)


GPIPE = "    warmup = microbatches\n"
EMPTY_THE_LAYOUTS = """

import sys as _sys

_frame = _sys._getframe(0)
while _frame is not None and not isinstance(_frame.f_locals.get("given"), dict):
    _frame = _frame.f_back
for _inputs in _frame.f_locals["given"].values():  # only the checks that read one_f_one_b's lists as data
    if isinstance(_inputs, dict) and "layouts" in _inputs:                      # before the contract
        _inputs["layouts"].clear()
    elif isinstance(_inputs, list) and _inputs and "pp" in _inputs[0][1]:      # [[case id, inputs], ...]
        _inputs.clear()
"""


@pytest.mark.grading_scale
@pytest.mark.timeout(600)
def test_lab12_gpipe_with_emptied_layouts_keeps_only_what_gpipe_earns(tmp_path, no_leftover_ranks):
    """Before the contract: 7/7 (the five checks of the lists judged no layout and passed). Now they fail, and GPipe
    keeps only the real run, which it passes honestly (its lists train the GPT right)."""
    reference = (LABS / "12-pipeline" / "solution.py").read_text()
    assert reference.count("    warmup = min(pp - rank - 1, microbatches)\n") == 1
    gpipe = reference.replace("    warmup = min(pp - rank - 1, microbatches)\n", GPIPE)
    (tmp_path / "gpipe.py").write_text(gpipe + EMPTY_THE_LAYOUTS)
    score = grade(LABS / "12-pipeline", tmp_path / "gpipe.py")
    passed = [r.name.split(":")[0] for r in score.results if r.passed]
    assert passed == ["on real ranks, pp = 2, 3, 4"] and score.total == 2, format_score(score)
    assert all(
        "sent no observation" in r.message or "graded on the course platform" in r.message or r.hidden
        for r in score.results
        if not r.passed
    ), format_score(score)


@pytest.mark.grading_scale
@pytest.mark.timeout(600)
@pytest.mark.parametrize("lab, maximum", [("04-moe-dispatch", 13), ("09-tutel-pipeline", 9)])
def test_skeleton_with_emptied_inputs_scores_zero(lab, maximum, tmp_path, no_leftover_ranks):
    """Before the contract: lab 04 2/13, lab 09 5/9 (its hidden check included)."""
    LabGrading(lab, maximum, {}).assert_attack_scores(EMPTY_THE_INPUTS, 0, tmp_path)


LOOKUP_TABLE = """
# lab 10 answered from a table of the values the released steps.json used to hold, with no formula at all
_COPIED = {  # (op, size, n, alpha, beta) -> seconds, as steps.json held them
    (op, size, n, alpha, beta): (2 * (n - 1) if op == "all_reduce" else n - 1) * (alpha + size / n * beta)
    for op in ("all_reduce", "reduce_scatter", "all_gather")
    for size, n, alpha, beta in [(1024, 2, 1e-5, 1e-9), (10 * 2**20, 8, 5e-6, 1 / 25e9), (3 * 2**20, 3, 1e-3, 1e-8),
                                 (12345, 64, 2e-6, 1e-10), (2**30, 512, 9.6e-6, 1 / 200e9), (2**20, 1, 1e-5, 1e-9)]}


def _lookup(op):
    return lambda size, n, alpha, beta: _COPIED.get((op, size, n, alpha, beta), 0.0)


all_reduce_time, reduce_scatter_time, all_gather_time = map(_lookup, ("all_reduce", "reduce_scatter", "all_gather"))


def step_time(program, compute_seconds, comm_seconds):
    return {"step": 0.0, "compute": 0.0, "exposed_comm": 0.0, "overlapped_comm": 0.0}
"""


@pytest.mark.grading_scale
@pytest.mark.timeout(600)
def test_lab10_lookup_table_with_emptied_inputs_scores_zero(tmp_path, no_leftover_ranks):
    """Before the contract: 14/14, the three hidden points included, with the expected values steps.json held."""
    LabGrading("10-cost-model", 14, {}).assert_attack_scores(LOOKUP_TABLE + EMPTY_THE_INPUTS, 0, tmp_path, whole=True)


# --- no lab's judge can undo it --------------------------------------------------------------------------------
def _labs():
    return sorted(p for p in LABS.iterdir() if (p / "checks.py").exists())


@pytest.mark.parametrize("lab", _labs(), ids=lambda p: p.name)
def test_every_check_of_every_lab_declares_what_its_task_returns(lab):
    checks, _ = lab_checks(lab)
    assert all(c.returns is not None for c in checks), [c.name for c in checks if c.returns is None]


@pytest.mark.parametrize("lab", _labs(), ids=lambda p: p.name)
def test_no_judge_pairs_cases_with_answers_by_position(lab):
    """The old pattern, `zip(cases, got[...])`, is how an emptied list of answers passed: a judge reads answers by
    case (the framework calls it once per case), never by zipping a list a rank sent."""
    for name in ("checks.py", "hidden_checks.py"):
        if not (lab / name).exists():
            continue
        for node in ast.walk(ast.parse((lab / name).read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "zip":
                assert "got" not in ast.unparse(node), f"{lab.name}/{name}: {ast.unparse(node)}"
