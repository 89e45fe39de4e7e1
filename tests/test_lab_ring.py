"""Tests for the grader (toolkit/grading) on lab 01: it gives 0 to the skeleton, full marks to the
reference, 0 to a submission that hands the work to the toolkit's own ring, partial marks with a message
naming the rank to a subtly wrong solution, and it survives checks that raise on one rank only or kill a
rank."""

from pathlib import Path

import pytest
from lab_grading import LabGrading

from toolkit.grading import format_score, grade, grade_command, main

LAB = Path(__file__).resolve().parent.parent / "labs" / "01-ring-allreduce"
RING = LabGrading("01-ring-allreduce", 13, {})


@pytest.mark.timeout(300)
def test_untouched_skeleton_scores_zero(no_leftover_ranks):
    score = grade(LAB)
    assert score.maximum == 13 and score.total == 0
    for result in score.results:
        assert "not implemented yet" in result.message, result
        assert result.message.startswith(("world size 3, rank 0", "world size 4, rank 0")), result.message
    report = format_score(score)
    assert "Score: 0/13" in report and "FAIL [0/2] all-gather" in report


@pytest.mark.timeout(300)
def test_reference_solution_scores_full_marks(no_leftover_ranks):
    score = grade(LAB, LAB / "solution.py")
    assert score.total == score.maximum == 13, format_score(score)
    assert all(r.passed for r in score.results)


def test_the_toolkits_own_ring_scores_zero(tmp_path):
    RING.assert_delegation_scores_zero(
        "from toolkit.comm.ring import all_reduce  # noqa: F811", "toolkit.comm.ring", tmp_path
    )


@pytest.mark.timeout(300)
def test_off_by_one_chunk_in_all_gather_scores_partial_and_names_the_rank(tmp_path, no_leftover_ranks):
    reference = (LAB / "solution.py").read_text()
    wrong = reference.replace(
        "pass_along(chunks[(me - step) % n], chunks[(me - step - 1) % n]",
        "pass_along(chunks[(me - step + 1) % n], chunks[(me - step) % n]",
    )
    assert wrong != reference
    (tmp_path / "off_by_one.py").write_text(wrong)
    score = grade(LAB, tmp_path / "off_by_one.py")
    by_name = {r.name.split(":")[0]: r for r in score.results}
    assert 0 < score.total < score.maximum, format_score(score)
    assert by_name["reduce-scatter, SUM"].passed  # the reduce-scatter half is right
    gather = by_name["all-gather"]
    assert not gather.passed and gather.earned == 0
    assert gather.message.startswith(
        "world size 3, all_gather of 1x3 float32 inputs: rank 0: blocks [0, 1, 2] were never written"
    ), gather.message  # the mistake named, not floats


SYNTHETIC_TASKS = """
import os
import torch
import torch.distributed as dist

def passes(student, rank, given):
    return {"answer": student.answer()}

def wrong(student, rank, given):
    return {"answer": student.answer() + rank.rank}

def one_sided(student, rank, given):
    if rank.rank == 1:
        raise IndexError("chunk 3 of 3")
    dist.recv(torch.zeros(2), 1, group=rank.group)

def dies(student, rank, given):
    if rank.rank == 0:
        print("going down")
        os._exit(3)

def last(student, rank, given):
    return {"answer": student.answer()}
"""

SYNTHETIC_CHECKS = """
import torch
from toolkit.grading import check

def the_answer(ctx, given, got):
    for r in range(ctx.world_size):
        ctx.expect(torch.tensor([got[r]["answer"]]), torch.tensor([42]), "the answer", rank=r)

passes = check("passes", points=1, world_sizes=(2,), task="passes")(the_answer)
wrong = check("wrong on rank 1", points=1, world_sizes=(2,), task="wrong")(the_answer)
one_sided = check("raises on rank 1 while rank 0 waits for it", points=1, world_sizes=(2,), task="one_sided")(
    the_answer)
dies = check("rank 0 dies", points=1, world_sizes=(2,), task="dies")(the_answer)
last = check("passes at the end", points=2, world_sizes=(2,), task="last")(the_answer)
"""


@pytest.mark.timeout(300)
def test_grader_contains_one_sided_failures_and_dead_ranks(tmp_path, no_leftover_ranks):
    (tmp_path / "tasks.py").write_text(SYNTHETIC_TASKS)
    (tmp_path / "checks.py").write_text(SYNTHETIC_CHECKS)
    (tmp_path / "skeleton.py").write_text("def answer():\n    return 42\n")
    score = grade(tmp_path, check_timeout_s=10)
    results = {r.name: r for r in score.results}
    assert [r.earned for r in score.results] == [1, 0, 0, 0, 2], format_score(score)
    assert "world size 2, the answer: rank 1 got [43] expected [42]" in results["wrong on rank 1"].message
    one_sided = results["raises on rank 1 while rank 0 waits for it"].message
    assert one_sided.startswith("world size 2, rank 1: IndexError: chunk 3 of 3"), one_sided
    died = results["rank 0 dies"].message
    assert "rank 0 died with exit code 3" in died and "rank 0 printed: going down" in died, died


def test_command_line_reports_a_missing_lab(tmp_path, capsys):
    assert grade_command(tmp_path / "no-such-lab") == 2
    assert "not a lab folder" in capsys.readouterr().err
    assert main([str(tmp_path / "no-such-lab"), "--quiet"]) == 2
