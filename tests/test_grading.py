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


@pytest.mark.grading_scale  # beyond the suite's budget: `make test-grading` (about 9 s on 2 cores)
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


def test_reports_a_platform_reads_and_exit_codes():
    from toolkit.grading import CheckResult, Score
    from toolkit.grading.report import as_json, exit_code

    score = Score("labs/x", "alice.py", [CheckResult("ring", 2, 2), CheckResult("bytes", 1, 0, "rank 1 sent 9"),
                                         CheckResult("secret", 3, 0, "wrong at degree 4", hidden=True)])
    scope = as_gradescope(score, elapsed_s=4.2)
    assert (scope["score"], scope["max_score"], scope["execution_time"]) == (2.0, 6.0, 4.2)
    assert [t["visibility"] for t in scope["tests"]] == ["visible", "visible", "after_published"]
    assert scope["tests"][1] == {"name": "bytes", "number": "2", "score": 0.0, "max_score": 1.0,
                                 "status": "failed", "output": "rank 1 sent 9", "visibility": "visible"}
    assert "wrong at degree 4" not in scope["output"] and "3 points in checks shown once" in scope["output"]
    plain = json.loads(render(score, "json"))
    assert plain == as_json(score) and plain["checks"][2]["hidden"] and plain["score"] == 2
    assert exit_code(score) == 1 and exit_code(Score("x", "y", [CheckResult("a", 1, 1)])) == 0
    with pytest.raises(ValueError, match="gradescope"):
        render(score, "xml")


@pytest.mark.timeout(60)
def test_command_line_exit_codes_for_what_cannot_be_graded(tmp_path, capsys):
    assert main([str(tmp_path / "no-such-lab"), "--format", "json"]) == 2
    assert "not a lab folder" in capsys.readouterr().err
    assert main([str(LABS / "06-zero"), "--solution", str(tmp_path / "missing.py")]) == 2


CLASS_CHECKS = '''
from toolkit.grading import check

@check("the answer", points=2, world_sizes=(1,))
def answer(student, ctx):
    ctx.expect(__import__("torch").tensor(student.answer()), __import__("torch").tensor(42), "the answer")
'''

HANGS_AT_IMPORT = '''
import os, time
child = os.fork()
if child == 0:              # a child that would outlive its parent, in a session of its own
    os.setsid()
    time.sleep(600)
    os._exit(0)
with open({pids!r}, "w") as f:
    f.write(str(child))
time.sleep(600)
'''


@pytest.mark.grading_scale  # beyond the suite's budget: `make test-grading` (about 14 s: a submission's timeout)
@pytest.mark.timeout(120)
def test_a_class_folder_grades_to_a_csv_and_one_hang_costs_only_its_timeout(tmp_path):
    from toolkit.grading.classroom import grade_class

    lab = tmp_path / "lab"
    lab.mkdir()
    (lab / "checks.py").write_text(CLASS_CHECKS)
    (lab / "skeleton.py").write_text("def answer():\n    raise NotImplementedError\n")
    submissions = tmp_path / "submissions"
    (submissions / "carol").mkdir(parents=True)  # a folder with no Python file in it
    (submissions / "alice.py").write_text("def answer():\n    return 42\n")
    rows = grade_class(lab, submissions, tmp_path / "scores.csv", out_dir=tmp_path / "feedback", progress=False)
    with open(tmp_path / "scores.csv") as f:
        table = {row["student"]: row for row in csv.DictReader(f)}
    assert (table["alice"]["score"], table["alice"]["max_score"], table["alice"]["status"]) == ("2", "2", "graded")
    assert table["alice"]["the answer"] == "2"
    assert table["carol"]["status"] == "no file" and table["carol"]["max_score"] == "2"
    assert json.loads((tmp_path / "feedback" / "alice.json").read_text())["checks"][0]["passed"]
    assert not [r for r in rows if r.status == "grader error"]
    # A submission that hangs (at import, where no check's watchdog runs yet) and leaves a child behind:
    # it costs its timeout, scores 0, and nothing of it survives.
    (tmp_path / "hangs").mkdir()
    (tmp_path / "hangs" / "bob.py").write_text(HANGS_AT_IMPORT.format(pids=str(tmp_path / "bob-child")))
    rows = grade_class(lab, tmp_path / "hangs", tmp_path / "bob.csv", student_timeout_s=8, progress=False)
    assert (rows[0].status, rows[0].score, rows[0].max_score) == ("timed out after 8 s", 0, 2)
    child = int((tmp_path / "bob-child").read_text())  # the fork happened before the timeout...
    assert not _alive(child), "bob's child survived the class grading"  # ...and did not outlive it
    leftovers = [pid for pid in os.listdir("/proc") if pid.isdigit() and "bob.py" in _cmdline(pid)]
    assert not leftovers, "bob's processes survived the class grading"


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""
