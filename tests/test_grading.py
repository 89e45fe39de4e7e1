"""The grader at scale: what a misbehaving solution costs (it is stopped, scored and leaves nothing
running), the lab-01 deadlock found in seconds with the line of each rank, and the forms a course
platform reads (Gradescope's results.json, plain JSON, exit codes, a class folder to a CSV)."""
import csv
import json
import os
import time
from pathlib import Path

import pytest

from toolkit.grading import Limits, grade, main
from toolkit.grading.isolation import marked
from toolkit.grading.report import as_gradescope, render

LABS = Path(__file__).resolve().parent.parent / "labs"

MISBEHAVING_CHECKS = '''
import torch
import torch.distributed as dist
from toolkit.grading import check

@check("starts processes that outlive the rank", points=1, world_sizes=(2,))
def forks(student, ctx):
    student.start_children()

@check("eats memory", points=1, world_sizes=(2,))
def eats(student, ctx):
    student.eat()

@check("waits for a message nobody sends", points=1, world_sizes=(2,))
def one_sided(student, ctx):
    student.wait_for_rank0(ctx.group)

@check("never ends", points=2, world_sizes=(2,))
def endless(student, ctx):
    student.spin()
'''

MISBEHAVING_SOLUTION = '''
import os, subprocess, time
import torch
import torch.distributed as dist

PIDS = {pids!r}

def start_children():
    child = subprocess.Popen(["sleep", "300"], start_new_session=True)  # escapes the process group
    pid = os.fork()
    if pid == 0:
        time.sleep(300)
        os._exit(0)
    with open(PIDS, "a") as f:
        f.write(f"{{child.pid}} {{pid}}\\n")

def eat():
    hog = []
    while True:
        hog.append(torch.ones(2 ** 24))  # 64 MiB at a time, touched

def wait_for_rank0(group):
    if dist.get_rank() == 1:
        dist.recv(torch.zeros(3), 0, group=group)

def spin():
    while True:
        pass
'''


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(120)
def test_a_misbehaving_solution_is_stopped_scored_and_leaves_nothing_running(tmp_path, no_leftover_ranks):
    (tmp_path / "checks.py").write_text(MISBEHAVING_CHECKS)
    pids = tmp_path / "pids.txt"
    (tmp_path / "skeleton.py").write_text(MISBEHAVING_SOLUTION.format(pids=str(pids)))
    score = grade(tmp_path, limits=Limits(check_timeout_s=30, stall_s=2, time_limit_s=3, memory_limit_mb=512))
    results = {r.name: r for r in score.results}
    assert results["starts processes that outlive the rank"].passed
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 4 and not [p for p in started if _alive(p)], "a solution's process survived grading"
    memory = results["eats memory"].message
    assert "ran out of memory" in memory and "line" in memory, memory
    one_sided = results["waits for a message nobody sends"].message
    assert "rank 1 waited more than 2 s for messages that no rank will send: rank 0 already finished" \
        in one_sided and "line" in one_sided and "dist.recv" in one_sided, one_sided
    endless = results["never ends"].message
    assert "still running this check after 3 s" in endless and "`while True:`" in endless, endless
    assert score.total == 1 and score.maximum == 5


@pytest.mark.timeout(60)
def test_lab01_deadlock_is_found_once_with_each_ranks_line(tmp_path, no_leftover_ranks):
    reference = (LABS / "01-ring-allreduce" / "solution.py").read_text()
    old = ("    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right, group),\n"
           "                                    dist.P2POp(dist.irecv, receive, left, group)])\n"
           "    for work in works:\n        work.wait()\n")
    assert reference.count(old) == 1, "the reference's pass_along changed: update this test"
    (tmp_path / "blocking.py").write_text(reference.replace(
        old, "    dist.send(send, right, group)\n    dist.recv(receive, left, group)\n"))
    line = reference.replace(old, "    dist.send(send, right, group)\n").splitlines().index(
        "    dist.send(send, right, group)") + 1
    started = time.monotonic()
    score = grade(LABS / "01-ring-allreduce", tmp_path / "blocking.py")
    elapsed = time.monotonic() - started
    first, *rest = score.results
    assert score.total == 0 and first.message.startswith("world size 3, deadlock: every rank"), first.message
    for rank in range(3):
        assert f"rank {rank} is blocked at blocking.py line {line} (`dist.send(send, right, group)`)" \
            in first.message, first.message
    assert "blocking send" in first.message  # the hint names the cause
    assert all(r.message.startswith("not run: grading stopped at check 'all-gather") for r in rest)
    print(f"deadlock graded in {elapsed:.1f} s")  # ~10 s on 2 loaded cores (3 minutes before the watchdog)
