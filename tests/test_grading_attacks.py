"""A submission is untrusted: every forgery, leak and containment case of issue 20's trial, replayed on a tiny
lab. Each one scored marks (or hung, or leaked) when the student's code ran inside the grader's process;
each must now score zero or fail closed with a clear message, and leave no process behind.

The attacks are written as a worst-case student would: knowing the paths of the grader's files (the test
puts them in the submission's source). Each costs a grading (seconds): five run in the suite (an exit at
import on the Gradescope path, the secrets, a class run where one submission attacks another, a submission
that goes after the processes above it, the launchers started without the fork server); the rest carry
the `grading_scale` marker (`make test-grading`)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from toolkit.grading import Limits, format_score, grade, main

AT_SCALE = pytest.mark.grading_scale

TASKS = """
import torch.distributed as dist

def total(student, rank, given):
    return {"value": student.total(given["xs"])}

def summed(student, rank, given):
    x = given["x"].clone()
    student.summed(x, rank.group)
    return {"x": x}
"""

CHECKS = """
import torch
from toolkit.grading import check

ANSWERS = {"toolkit.comm.ring": "the toolkit's own ring collectives"}

@check("the total of five numbers", points=2, world_sizes=(1,),
       inputs=lambda n, g: {"xs": torch.randn(5, generator=g, dtype=torch.float64)})
def total(ctx, given, got):
    ctx.expect(got[0]["value"], given[0]["xs"].sum(), "the total", exact=False)
"""

SUMMED = """
@check("the sum over two ranks", points=1, world_sizes=(2,),
       inputs=lambda n, g: [{"x": torch.randn(4, generator=g)} for _ in range(n)])
def summed(ctx, given, got):
    for r in range(2):
        ctx.expect(got[r]["x"], given[0]["x"] + given[1]["x"], "the sum", rank=r, exact=False)
"""

HIDDEN = """
import torch
from toolkit.grading import check
SECRET = "SECRET-HIDDEN-7f3a: the expected total is computed here"

@check("the total of nine numbers", points=1, world_sizes=(1,), task="total", feedback="a longer list went wrong",
       inputs=lambda n, g: {"xs": torch.randn(9, generator=g, dtype=torch.float64)})
def hidden_total(ctx, given, got):
    ctx.expect(got[0]["value"], given[0]["xs"].sum(), SECRET, exact=False)
"""

SKELETON = """
def total(xs):
    raise NotImplementedError("total: add them up")

def summed(x, group):
    raise NotImplementedError("summed: an all-reduce")
"""

SOLUTION = """
import torch.distributed as dist

def total(xs):
    return xs.sum()

def summed(x, group):
    dist.all_reduce(x, group=group)
"""


@pytest.fixture
def lab(tmp_path):
    folder = tmp_path / "lab"
    folder.mkdir()
    (folder / "tasks.py").write_text(TASKS)
    (folder / "checks.py").write_text(CHECKS)
    (folder / "hidden_checks.py").write_text(HIDDEN)
    (folder / "skeleton.py").write_text(SKELETON)
    (folder / "solution.py").write_text(SOLUTION)
    return folder


def _submission(tmp_path, attack: str, name: str = "attack.py") -> Path:
    path = tmp_path / name
    path.write_text(SKELETON + attack)
    return path


def _survivors(tag: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if tag.encode() in f.read():
                    found.append(pid)
        except OSError:
            pass
    return found


def _gradescope(lab, solution, tmp_path, **limits) -> tuple[int, dict]:
    results = tmp_path / "results" / "results.json"
    options = [f"--{k.replace('_', '-')}={v}" for k, v in limits.items()]
    code = main(
        [str(lab), "--solution", str(solution), "--format", "gradescope", "--output", str(results), "--quiet", *options]
    )
    return code, json.loads(results.read_text())


@AT_SCALE
def test_the_reference_scores_full_and_the_skeleton_zero(lab, no_leftover_ranks):
    assert grade(lab, lab / "solution.py").total == 3
    score = grade(lab)
    assert score.total == 0 and "not implemented yet (total: add them up)" in score.results[0].message
    assert score.results[1].message == "a longer list went wrong" and "not implemented" in score.results[1].detail
    assert score.results[0].message.startswith("not implemented yet")  # one rank, no process group: no "rank 0"


# --- forged scores ---------------------------------------------------------------------------------------
FORGERIES = {
    "patches the report and the grader's functions at import": """
import toolkit.grading.report as report, toolkit.grading.score as score, toolkit.grading.grader as grader
report.render = lambda *a, **k: '{"score": 99, "max_score": 3, "tests": []}'
report.exit_code = lambda score: 0
score.format_score = lambda s: "Score: 3/3"
grader._verdict = lambda *a, **k: ""
""",
    "replaces every task with a no-op": """
import sys
for name in ("total", "summed"):
    setattr(sys.modules["lab_tasks"], name, lambda *a, **k: None)
""",
    "writes 'passed' results for every check, then os._exit(0)": """
import gc, json, os
spec = next(o for o in gc.get_objects() if isinstance(o, dict) and "out" in o and "indices" in o)
for index in ["import", *spec["indices"], 0, 1, 2]:
    with open(os.path.join(spec["out"], f"check-{index}-rank-0.json"), "w") as f:
        json.dump({"ok": {"value": 0.0}, "error": "", "delegated": [], "time": 0}, f)
os._exit(0)
""",
    "exits with sys.exit(0) at import": "import sys\nsys.exit(0)\n",
    "exits with os._exit(0) at import": "import os\nos._exit(0)\n",
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "attack",
    [a if a.startswith("exits with sys.exit") else pytest.param(a, marks=AT_SCALE) for a in FORGERIES],
    ids=lambda a: a.split(" at ")[0].replace(" ", "-")[:40],
)
def test_a_forged_score_scores_zero_and_results_json_is_written(attack, lab, tmp_path, no_leftover_ranks):
    code, results = _gradescope(lab, _submission(tmp_path, FORGERIES[attack]), tmp_path)
    assert code == 1 and results["score"] == 0 and results["max_score"] == 3, results
    assert all(t["status"] == "failed" for t in results["tests"]) and len(results["tests"]) == 2
    if attack.startswith("exits"):
        message = results["tests"][0]["output"]
        assert message.startswith("your file does not import"), message
        assert ("sys.exit(0)" if "sys.exit" in attack else "exited with code 0") in message, message


@AT_SCALE
@pytest.mark.timeout(300)
def test_an_atexit_hook_and_a_daemon_cannot_rewrite_results_json(lab, tmp_path, no_leftover_ranks):
    results = tmp_path / "results" / "results.json"
    forged = json.dumps({"score": 3, "max_score": 3, "tests": []})
    attack = f"""
import atexit, os, time
def forge():
    try:
        open({str(results)!r}, "w").write({forged!r})
    except OSError:
        pass
atexit.register(forge)
if os.fork() == 0:
    os.setsid()
    for _ in range(600):      # keeps trying after the grader has written its results
        forge()
        time.sleep(0.1)
    os._exit(0)
"""
    code, first = _gradescope(lab, _submission(tmp_path, attack), tmp_path)
    time.sleep(2)
    assert code == 1 and json.loads(results.read_text()) == first and first["score"] == 0, first
    assert not _survivors(str(tmp_path / "attack.py"))


# --- secrets ---------------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_the_hidden_checks_and_the_solution_cannot_be_read(lab, tmp_path, no_leftover_ranks):
    attack = f"""
import sys
for path in ({str(lab / "hidden_checks.py")!r}, {str(lab / "checks.py")!r}):
    try:
        text = open(path).read()
    except OSError as exc:
        text = str(exc)
    print(text)
try:
    exec(open({str(lab / "solution.py")!r}).read())     # the reference, beside checks.py
except OSError:
    pass
raise RuntimeError("here it is: " + text)
"""
    code, results = _gradescope(lab, _submission(tmp_path, attack), tmp_path)
    text = json.dumps(results)
    assert results["score"] == 0 and "SECRET" not in text and "ctx.expect" not in text, text
    said = results["tests"][0]["output"]  # landlock refuses the path; or, where the launch has a /tmp of its own, it
    assert "Permission denied" in said or "No such file or directory" in said, results  # is not there (this lab's)
    hidden = results["tests"][1]
    assert hidden["visibility"] == "after_published" and hidden["output"] == "a longer list went wrong"


@AT_SCALE
@pytest.mark.timeout(300)
def test_the_callers_frames_hold_no_other_ranks_inputs_and_no_expected_value(lab, tmp_path, no_leftover_ranks):
    (lab / "checks.py").write_text(CHECKS + SUMMED)
    attack = """
import gc, sys, torch

def summed(x, group):   # no message sent: add up every tensor of x's shape this process can find
    found = {id(o): o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.shape == x.shape}
    frame = sys._getframe(1)
    while frame is not None:
        for value in frame.f_locals.values():
            if isinstance(value, dict):
                found.update({id(v): v for v in value.values() if isinstance(v, torch.Tensor) and v.shape == x.shape})
        frame = frame.f_back
    others = [t for i, t in found.items() if i != id(x) and not torch.equal(t, x)]
    x.add_(sum(others[:1], torch.zeros_like(x)))
"""
    score = grade(lab, _submission(tmp_path, attack))
    summed = next(r for r in score.results if r.name == "the sum over two ranks")
    assert summed.earned == 0 and "the sum: rank 0 got" in summed.message, format_score(score)


@AT_SCALE
# --- containment -----------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_an_endless_loop_at_import_is_stopped(lab, tmp_path, no_leftover_ranks):
    started = time.monotonic()
    score = grade(lab, _submission(tmp_path, "while True:\n    pass\n"), limits=Limits(time_limit_s=3, stall_s=2))
    assert time.monotonic() - started < 60
    assert score.total == 0
    message = score.results[0].message
    assert "still importing your file after 3 s" in message and "`while True:`" in message, message


@AT_SCALE
@pytest.mark.timeout(300)
def test_memory_at_import_is_limited(lab, tmp_path, no_leftover_ranks):
    attack = "import torch\nHOG = torch.ones(2 ** 28)  # 1 GiB at import\n"
    score = grade(lab, _submission(tmp_path, attack), limits=Limits(memory_limit_mb=512))
    assert score.total == 0
    message = score.results[0].message
    assert message.startswith("your file does not import: ran out of memory"), message


@AT_SCALE
@pytest.mark.timeout(300)
def test_too_many_processes_are_stopped(lab, tmp_path, no_leftover_ranks):
    attack = """
import os, time
for _ in range(40):        # a (gentle) fork bomb: 40 processes that would sleep for a minute
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
time.sleep(60)
"""
    score = grade(lab, _submission(tmp_path, attack), limits=Limits(max_processes=20))
    assert score.total == 0 and "started more than 20 processes" in score.results[0].message, format_score(score)


@AT_SCALE
@pytest.mark.timeout(300)
def test_grade_from_python_leaves_no_process_behind(lab, tmp_path, no_leftover_ranks):
    attack = """
import os
if os.fork() == 0:            # a daemon in a session of its own, with an empty environment
    os.setsid()
    if os.fork() == 0:
        os.execve("/bin/sleep", ["/bin/sleep", "6017"], {})
    os._exit(0)
"""
    grade(lab, _submission(tmp_path, attack))
    time.sleep(0.5)
    assert not [pid for pid in _survivors("6017") if "sleep" in Path(f"/proc/{pid}/cmdline").read_text()]


# --- the answers ship with the toolkit -------------------------------------------------------------------------
DELEGATIONS = {
    "imports the toolkit's ring": """
import torch.distributed as dist
from toolkit.comm.ring import all_reduce

def summed(x, group):
    all_reduce(x, dist.ReduceOp.SUM, group)
""",
    "reaches it by a computed name": """
import importlib
import torch.distributed as dist

def summed(x, group):
    getattr(importlib.import_module("toolkit.comm." + "ri" + "ng"), "all_" + "reduce")(x, dist.ReduceOp.SUM, group)
""",
}


@AT_SCALE
@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", list(DELEGATIONS))
def test_a_delegation_to_the_toolkit_scores_zero_and_says_so(how, lab, tmp_path, no_leftover_ranks):
    (lab / "checks.py").write_text(CHECKS + SUMMED)
    score = grade(lab, _submission(tmp_path, DELEGATIONS[how]))
    summed = next(r for r in score.results if r.name == "the sum over two ranks")
    assert summed.earned == 0 and "toolkit.comm.ring" in summed.message, format_score(score)
    assert "the toolkit's own implementation of what this lab asks you to write" in summed.message


# --- a class ----------------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_in_a_class_run_one_submission_cannot_touch_anothers(lab, tmp_path, no_leftover_ranks):
    from toolkit.grading.classroom import grade_class

    submissions = tmp_path / "submissions"
    submissions.mkdir()
    attack = f"""
import glob, os
for path in glob.glob({str(submissions)!r} + "/*.py") + glob.glob("/tmp/toolkit-*/**/*.py", recursive=True):
    try:
        open(path, "w").write("def total(xs):\\n    return 0\\n")
    except OSError:
        pass
"""
    (submissions / "alice.py").write_text(SKELETON + attack)
    (submissions / "bob.py").write_text(SOLUTION)
    rows = {r.student: r for r in grade_class(lab, submissions, tmp_path / "scores.csv", progress=False)}
    assert (rows["alice"].score, rows["bob"].score) == (0, 3), rows
    assert (submissions / "bob.py").read_text() == SOLUTION


@AT_SCALE
@pytest.mark.timeout(300)
@pytest.mark.parametrize("crash", ["raise ImportError('no such thing')\n", "import sys\nsys.exit(0)\n"])
def test_run_autograder_writes_results_json_whatever_the_submission_does(crash, lab, tmp_path, no_leftover_ranks):
    root = tmp_path / "autograder"
    (root / "source" / "labs").mkdir(parents=True)
    (root / "submission").mkdir()
    (root / "source" / "labs" / "lab").symlink_to(lab)
    (root / "source" / "LAB").write_text("lab\n")
    (root / "submission" / "mine.py").write_text(SKELETON + crash)
    run_autograder = Path(__file__).resolve().parent.parent / "labs" / "autograder" / "run_autograder"
    env = dict(os.environ, AUTOGRADER_ROOT=str(root), PYTHON=sys.executable)
    done = subprocess.run([str(run_autograder)], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    results = json.loads((root / "results" / "results.json").read_text())
    assert results["score"] == 0 and results["max_score"] == 3, results
    assert results["tests"][0]["output"].startswith("your file does not import"), results


# --- the processes above a submission --------------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.skipif(
    __import__("toolkit.grading.sandbox").grading.sandbox.landlock_abi() < 6,
    reason="signals out of the sandbox are refused by landlock ABI 6+ (Linux 6.12)",
)
def test_a_submission_reaches_none_of_the_processes_above_it(lab, tmp_path, no_leftover_ranks):
    """Its keeper, the sandbox zygote that forked that, and the grading's fork server (which forks every launch
    of the grading and holds no secret, but must serve the next launch): each one a SIGKILL away if the sandbox
    let it (forked, they all show the server's command line). Both launches (world sizes 1 and 2) must still
    run, to full marks. (Without landlock the same climb, taken up to init, killed the shell running pytest.)
    In a PID namespace of the launch's own, the climb ends at the namespace's first process: the grading's
    server is not even there to find."""
    (lab / "checks.py").write_text(CHECKS + SUMMED)
    attack = """
import os, signal
pid, tried = os.getppid(), []
while pid > 0 and b"forkserver.py" in open(f"/proc/{pid}/cmdline", "rb").read():  # up to the server, not the grader
    try:
        os.kill(pid, signal.SIGKILL)
        tried.append((pid, "killed"))
    except OSError as exc:
        tried.append((pid, type(exc).__name__))
    with open(f"/proc/{pid}/stat") as f:
        pid = int(f.read().rsplit(")", 1)[1].split()[1])
in_a_namespace = pid == 0  # the climb ended at the top of a PID namespace
assert len(tried) >= (2 if in_a_namespace else 3) and all(how != "killed" for _, how in tried), tried
"""
    path = tmp_path / "climber.py"
    path.write_text(SOLUTION + attack)
    score = grade(lab, path)
    assert score.total == score.maximum == 4 and not score.results[0].message, format_score(score)


@pytest.mark.timeout(300)
def test_without_a_fork_server_each_launcher_is_a_fresh_interpreter_in_the_sandbox(
    lab, tmp_path, monkeypatch, no_leftover_ranks
):
    """Where no fork server can serve (no fork or pidfds; TOOLKIT_LAUNCH_EXEC=1 asks for it), the grader starts
    `python -m toolkit.grading.launcher` for each launch, which enters the sandbox itself: still full marks."""
    monkeypatch.setenv("TOOLKIT_LAUNCH_EXEC", "1")
    (lab / "checks.py").write_text(CHECKS + SUMMED)
    path = tmp_path / "plain.py"
    path.write_text(
        SOLUTION
        + """
import os
chain, pid = [], os.getppid()
while pid > 0:  # pid 1: init, or the launch's PID namespace's first process (the launcher, here)
    chain.append(open(f"/proc/{pid}/cmdline", "rb").read())
    pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
assert not any(b"forkserver.py" in c for c in chain) and any(b"toolkit.grading.launcher" in c for c in chain), chain
"""
    )
    score = grade(lab, path)
    assert score.total == score.maximum == 4, format_score(score)
