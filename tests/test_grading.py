"""The grader at scale: what a misbehaving solution costs (it is stopped, scored and leaves nothing
running), the lab-01 deadlock found in seconds with the line of each rank, and the forms a course
platform reads (Gradescope's results.json, plain JSON, exit codes, a class folder to a CSV)."""

import csv
import json
import os
import signal
import time
from pathlib import Path

import pytest

from toolkit.grading import Limits, grade, main
from toolkit.grading.report import as_gradescope, render

LABS = Path(__file__).resolve().parent.parent / "labs"

MISBEHAVING_TASKS = """
def forks(student, rank, given):
    student.start_children()

def eats(student, rank, given):
    student.eat()

def one_sided(student, rank, given):
    student.wait_for_rank0(rank.group)

def endless(student, rank, given):
    student.spin()
"""

MISBEHAVING_CHECKS = """
from toolkit.grading import check

def accept(ctx, given, got):
    pass

forks = check("starts processes that outlive the rank", points=1, world_sizes=(2,), task="forks")(accept)
eats = check("eats memory", points=1, world_sizes=(2,), task="eats")(accept)
one_sided = check("waits for a message nobody sends", points=1, world_sizes=(2,), task="one_sided")(accept)
endless = check("never ends", points=2, world_sizes=(2,), task="endless")(accept)
"""

MISBEHAVING_SOLUTION = """
import os, subprocess, time
import torch
import torch.distributed as dist

def start_children():
    child = subprocess.Popen(["sleep", "3017"], start_new_session=True)  # escapes the process group
    pid = os.fork()
    if pid == 0:
        time.sleep(300)
        os._exit(0)

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
"""


@pytest.mark.grading_scale  # beyond the suite's budget: `make test-grading` (about 15 s on 2 cores)
@pytest.mark.timeout(180)
def test_a_misbehaving_solution_is_stopped_scored_and_leaves_nothing_running(tmp_path, no_leftover_ranks):
    (tmp_path / "tasks.py").write_text(MISBEHAVING_TASKS)
    (tmp_path / "checks.py").write_text(MISBEHAVING_CHECKS)
    (tmp_path / "skeleton.py").write_text(MISBEHAVING_SOLUTION)
    score = grade(tmp_path, limits=Limits(check_timeout_s=30, stall_s=2, time_limit_s=3, memory_limit_mb=512))
    results = {r.name: r for r in score.results}
    assert results["starts processes that outlive the rank"].passed
    assert not [pid for pid in os.listdir("/proc") if pid.isdigit() and "3017" in _cmdline(pid)], (
        "a solution's process survived grading"
    )
    memory = results["eats memory"].message
    assert "ran out of memory" in memory and "line" in memory, memory
    one_sided = results["waits for a message nobody sends"].message
    assert (
        "rank 1 waited more than 2 s for messages that no rank will send: rank 0 already finished" in one_sided
        and "line" in one_sided
        and "dist.recv" in one_sided
    ), one_sided
    endless = results["never ends"].message
    assert "still running this check after 3 s" in endless and "`while True:`" in endless, endless
    assert score.total == 1 and score.maximum == 5


@pytest.mark.timeout(300)
def test_lab01_deadlock_is_found_once_with_each_ranks_line(tmp_path, no_leftover_ranks):
    reference = (LABS / "01-ring-allreduce" / "solution.py").read_text()
    old = (
        "    works = dist.batch_isend_irecv(\n"
        "        [dist.P2POp(dist.isend, send, right, group), dist.P2POp(dist.irecv, receive, left, group)]\n"
        "    )\n"
        "    for work in works:\n        work.wait()\n"
    )
    assert reference.count(old) == 1, "the reference's pass_along changed: update this test"
    (tmp_path / "blocking.py").write_text(
        reference.replace(old, "    dist.send(send, right, group)\n    dist.recv(receive, left, group)\n")
    )
    line = (
        reference.replace(old, "    dist.send(send, right, group)\n")
        .splitlines()
        .index("    dist.send(send, right, group)")
        + 1
    )
    started = time.monotonic()
    score = grade(LABS / "01-ring-allreduce", tmp_path / "blocking.py")
    elapsed = time.monotonic() - started
    first, *rest = score.results
    assert score.total == 0 and first.message.startswith("world size 3, deadlock: every rank"), first.message
    for rank in range(3):
        assert (
            f"rank {rank} is blocked at blocking.py line {line} (`dist.send(send, right, group)`)" in first.message
        ), first.message
    assert "blocking send" in first.message  # the hint names the cause
    assert all(r.message.startswith("not run: grading stopped at check 'all-gather") for r in rest)
    print(f"deadlock graded in {elapsed:.1f} s")  # ~10 s on 2 loaded cores (3 minutes before the watchdog)


def test_reports_a_platform_reads_and_exit_codes():
    from toolkit.grading import CheckResult, Score
    from toolkit.grading.report import as_json, exit_code

    score = Score(
        "labs/x",
        "alice.py",
        [
            CheckResult("ring", 2, 2),
            CheckResult("bytes", 1, 0, "rank 1 sent 9"),
            CheckResult("secret", 3, 0, "a degree went wrong", hidden=True, detail="wrong at degree 4: expected 17"),
        ],
    )
    scope = as_gradescope(score, elapsed_s=4.2)
    assert (scope["score"], scope["max_score"], scope["execution_time"]) == (2.0, 6.0, 4.2)
    assert [t["visibility"] for t in scope["tests"]] == ["visible", "visible", "after_published"]
    assert scope["tests"][1] == {
        "name": "bytes",
        "number": "2",
        "score": 0.0,
        "max_score": 1.0,
        "status": "failed",
        "output": "rank 1 sent 9",
        "output_format": "text",
        "visibility": "visible",
    }
    assert "a degree went wrong" not in scope["output"] and "3 points in checks shown once" in scope["output"]
    assert "expected 17" not in json.dumps(scope)  # a hidden check's own message never reaches Gradescope
    assert scope["tests"][2]["output"] == "a degree went wrong"
    plain = json.loads(render(score, "json"))
    assert plain == as_json(score) and plain["checks"][2]["hidden"] and plain["score"] == 2
    assert plain["checks"][2]["detail"] == "wrong at degree 4: expected 17"  # the instructor's report has it
    assert exit_code(score) == 1 and exit_code(Score("x", "y", [CheckResult("a", 1, 1)])) == 0
    with pytest.raises(ValueError, match="gradescope"):
        render(score, "xml")


@pytest.mark.timeout(60)
def test_command_line_exit_codes_for_what_cannot_be_graded(tmp_path, capsys):
    assert main([str(tmp_path / "no-such-lab"), "--format", "json"]) == 2
    assert "not a lab folder" in capsys.readouterr().err
    assert main([str(LABS / "06-zero"), "--solution", str(tmp_path / "missing.py")]) == 2


CLASS_TASKS = """
def answer(student, rank, given):
    return {"answer": student.answer()}
"""

CLASS_CHECKS = """
from toolkit.grading import check

@check("the answer", points=2, world_sizes=(1,))
def answer(ctx, given, got):
    if got[0]["answer"] != 42:
        ctx.fail(f"the answer is {got[0]['answer']!r}, expected 42")
"""

HANGS_AT_IMPORT = """
import os, time
if os.fork() == 0:              # a child that would outlive its parent, in a session of its own
    os.setsid()
    os.execv("/bin/sleep", ["/bin/sleep", "SLEEP"])
time.sleep(600)
"""


@pytest.mark.grading_scale  # beyond the suite's budget: `make test-grading` (about 30 s: a submission's timeout)
@pytest.mark.timeout(180)
def test_a_class_folder_grades_to_a_csv_and_one_hang_costs_only_its_timeout(tmp_path, monkeypatch):
    from toolkit.grading.classroom import grade_class

    lab = tmp_path / "lab"
    lab.mkdir()
    (lab / "tasks.py").write_text(CLASS_TASKS)
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
    # A submission that hangs and leaves a child behind: it costs its timeout, scores 0, nothing of it survives.
    (tmp_path / "hangs").mkdir()
    sleep = str(3019_000_000 + os.getpid())  # this test's own: another run of it may be going on beside it
    (tmp_path / "hangs" / "bob.py").write_text(HANGS_AT_IMPORT.replace("SLEEP", sleep))
    temp = tmp_path / "temp"  # where the timed-out grading makes its folders (TMPDIR), to see that none is left
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as from a shell's background job: the grading inherits it
    try:
        rows = grade_class(  # a stall limit past the timeout: the grading is still going on when it is stopped
            lab,
            tmp_path / "hangs",
            tmp_path / "bob.csv",
            student_timeout_s=8,
            options=["--stall", "60"],
            progress=False,
        )
    finally:
        signal.signal(signal.SIGINT, before)
    assert (rows[0].status, rows[0].score, rows[0].max_score, rows[0].report) == ("timed out after 8 s", 0, 2, None)
    assert not [p.name for p in temp.iterdir() if p.name.startswith("toolkit-grade-")], "bob's grading left its folder"
    leftovers = [
        pid
        for pid in os.listdir("/proc")
        if pid.isdigit() and (str(tmp_path) in _cmdline(pid) or sleep in _cmdline(pid))
    ]
    assert not leftovers, "bob's processes survived the class grading"


def test_a_class_is_graded_several_at_once_only_where_each_grading_has_its_own_pids(tmp_path, monkeypatch, capsys):
    """Without a PID namespace per grading, submissions graded at once run side by side as one user: one could signal
    or read another's ranks. --jobs above 1 is refused there (before anything is graded), unless --allow-unsandboxed."""
    from toolkit.grading import classroom, namespaces

    empty = tmp_path / "class"
    empty.mkdir()
    for made, jobs, refused in (([], 2, True), ([], 1, False), ([namespaces.OWN_PIDS], 2, False)):
        monkeypatch.setattr(namespaces, "probe", lambda made=made: made)
        with pytest.raises(ValueError if refused else FileNotFoundError) as caught:  # past the check: an empty class
            classroom.grade_class(tmp_path, empty, tmp_path / "scores.csv", jobs=jobs, progress=False)
        assert ("--jobs 2" in str(caught.value)) == refused, str(caught.value)
    monkeypatch.setattr(namespaces, "probe", lambda: [])
    assert main([str(tmp_path), "--class", str(empty), "--jobs", "3"]) == 2
    assert "--jobs 3 grades 3 submissions at once" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError):
        classroom.grade_class(tmp_path, empty, tmp_path / "s.csv", jobs=2, progress=False, allow_unsandboxed=True)


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def test_the_channel_from_the_ranks_carries_values_and_refuses_anything_else():
    """What a submission's rank sends is read as data: plain values and tensors come through exactly; a
    malformed tensor, a pickle, deep nesting or a huge file is a WireError (a failed check), never code run
    in the grader's process."""
    import pickle

    import torch

    from toolkit.grading import wire

    value = {
        "x": torch.arange(6, dtype=torch.float32).view(2, 3),
        "b": torch.tensor([1.5], dtype=torch.bfloat16),
        "n": [1, 2.5, None, True, "s", float("nan")],
        "pairs": {(0, 1): 3},
        "e": torch.empty(0, 4),
    }
    back = wire.decode(wire.encode(value))
    assert torch.equal(back["x"], value["x"]) and back["b"].dtype == torch.bfloat16 and back["e"].shape == (0, 4)
    assert back["n"][:5] == [1, 2.5, None, True, "s"] and back["n"][5] != back["n"][5] and back["pairs"] == {(0, 1): 3}
    assert isinstance(wire.decode(wire.encode(object())), wire.Opaque)  # a student's object: its type, not itself
    for garbage in (
        pickle.dumps({"ok": 1}),
        b"\xff\xfe",
        b'{"__tensor__": "float32", "shape": [2], "data": "AAAA"}',
        b'{"__tensor__": "object", "shape": [1], "data": ""}',
        b'{"__exec__": "print(1)"}',
        b"[" * 100 + b"]" * 100,
        b"[" + b"1," * (wire.MAX_BYTES // 2) + b"1]",
    ):
        with pytest.raises(wire.WireError):
            wire.decode(garbage)


@pytest.mark.timeout(180)
def test_each_grading_forks_its_server_from_one_the_process_started_once():
    """A process that grades many submissions (a notebook checking a lab again and again, this suite) imports
    torch for the graders' fork server once. Each grading's server is forked from it and carries the grading's
    id where /proc shows its environment: how the grader finds every process of a grading, daemons included,
    and stops them all but that server. The shared one carries no grading's id, and outlives the gradings."""
    from uuid import uuid4

    from toolkit.grading import isolation
    from toolkit.grading.box import ID_ROOM, Box
    from toolkit.grading.session import _env
    from toolkit.runtime import zygotes

    servers = []
    for grading_id in (uuid4().hex, uuid4().hex):
        with Box(LABS / "01-ring-allreduce", b"", "mine.py") as box:
            server = box.fork_server(_env(box, grading_id))
            assert server is not None, box.serverless
            assert isolation.marked(grading_id) == [server.process.pid]
            shared = isolation._parent(server.process.pid)
            with open(f"/proc/{shared}/environ", "rb") as f:
                assert f"{isolation.MARKER}={'-' * ID_ROOM}".encode() in f.read().split(b"\0")
            servers.append((server.process.pid, shared))
        assert not isolation.marked(grading_id), "a grading's server outlived its grading"
    (first, shared), (second, again) = servers
    assert first != second and shared == again and shared in zygotes.pids()
