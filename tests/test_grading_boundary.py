"""The process boundary between a submission and its grader (issue 29): each test replays an attack of the
issue's trial that broke the grader, and failed before the construction it tests.

What a submission's side can hand the grader is material, never an instruction: no file is read through a link
or past a cap, no text can change how a report looks, and the command line says what it was given wrong. The
cheap ones (no rank started, or a grading or two) run in the suite (about 30 s on 2 cores); the rest carry
`grading_scale` (`make test-grading`)."""

import json
import os
import threading
import time
from pathlib import Path

import pytest
from test_grading_attacks import TASKS, _submission, make_lab

from toolkit.grading import CheckResult, Limits, Score, format_score, grade, main
from toolkit.grading.report import render

LABS = Path(__file__).resolve().parent.parent / "labs"
AT_SCALE = pytest.mark.grading_scale


@pytest.fixture
def lab(tmp_path):
    return make_lab(tmp_path)


# An exception's text as a student would write it to fake a full score: conceal what follows (ESC[8m), move to the
# line's start, draw a green score, and separators that some viewers break lines at.
FAKE = (
    "\x1b[8m hidden \x1b[0m\r\x1b[2K\x1b[32mScore: 13/13\x1b[0m\u2028Score: 13/13\u2029\u202eScore: 13/13"
    "\x1b]0;title\x07\x00\x7f\u200b"
)
UNSAFE = ("\x1b", "\r", "\u2028", "\u2029", "\u202e", "\x00", "\x7f", "\u200b", "\x07")


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def test_feedback_cannot_fake_a_score_line_in_any_format():
    score = Score(
        "labs/x",
        f"mine{FAKE}.py",
        [
            CheckResult("ring", 2, 0, f"ValueError: {FAKE}\nsecond line"),
            CheckResult("secret", 1, 0, "a sentence", hidden=True, detail=FAKE),
        ],
    )
    text = format_score(score)
    assert not any(c in text for c in UNSAFE), repr(text)
    assert [line for line in text.splitlines() if line.startswith("Score")] == ["Score: 0/3"], text
    assert "\\x1b[32mScore: 13/13" in text and "\\u2028" in text  # shown, harmless, for the student to see
    assert "         second line" in text  # a message's own lines stay lines, indented under their check
    for fmt in ("json", "gradescope"):
        strings = list(_strings(json.loads(render(score, fmt))))
        assert strings and not any(c in s for s in strings for c in UNSAFE), (fmt, strings)


def test_grade_names_the_lab_a_short_name_meant(capsys):
    assert main([str(LABS / "01"), "--format", "json"]) == 2
    said = capsys.readouterr().err
    assert "is not a lab folder (no such folder)" in said and f"Did you mean {LABS / '01-ring-allreduce'}?" in said
    assert "12-pipeline" in said and "06-zero" in said, said  # and every lab there, to choose from


def test_a_report_written_to_output_is_not_printed_too(lab, tmp_path, capsys):
    """--output: "write the report here instead of printing it" (issue 32). A file that does not parse is graded
    without starting a rank, so this costs no launch; its name carries escapes, which the report shows harmlessly."""
    broken = tmp_path / "mine\x1b[8m.py"
    broken.write_text("def total(xs):\n    return (\n")
    results = tmp_path / "results.json"
    assert main([str(lab), "--solution", str(broken), "--format", "gradescope", "--output", str(results)]) == 1
    printed = capsys.readouterr()
    assert printed.out == "" and str(results) in printed.err, printed
    report = json.loads(results.read_text())
    assert report["score"] == 0 and "SyntaxError" in report["tests"][0]["output"]
    assert "\x1b" not in json.dumps(report, ensure_ascii=False) and "\\x1b[8m" in report["output"], report["output"]


# --- nothing follows a link ----------------------------------------------------------------------------------
def test_a_solution_that_is_a_link_is_refused(lab, tmp_path):
    """A link to the lab's own solution.py scored full marks: the grader read it through the link."""
    link = tmp_path / "mine.py"
    link.symlink_to(lab / "solution.py")
    results = tmp_path / "results.json"
    assert main([str(lab), "--solution", str(link), "--format", "gradescope", "--output", str(results), "--quiet"]) == 2
    report = json.loads(results.read_text())
    assert report["score"] == 0 and "is a link" in report["output"] and "copy the file itself" in report["output"]


def test_a_class_folders_links_are_refused_not_followed(lab, tmp_path):
    from toolkit.grading.classroom import grade_class

    submissions = tmp_path / "submissions"
    (submissions / "bob").mkdir(parents=True)
    (submissions / "alice.py").symlink_to(lab / "solution.py")  # a file that is a link
    (submissions / "bob" / "ring.py").symlink_to(lab / "solution.py")  # a link inside a student's folder
    (submissions / "carol").symlink_to(lab)  # a student's folder that is a link
    rows = {r.student: r for r in grade_class(lab, submissions, tmp_path / "scores.csv", progress=False)}
    assert {s: (r.score, r.status.split(":")[0]) for s, r in rows.items()} == {
        "alice": (0, "refused"),
        "bob": (0, "refused"),
        "carol": (0, "refused"),
    }, rows
    assert "is a link" in rows["alice"].status and "is a link" in rows["bob"].status


@pytest.mark.timeout(60)
@pytest.mark.parametrize("planted", ["a link to a FIFO", "a FIFO", "a link to /dev/zero", "a huge file"])
def test_a_planted_result_file_is_refused_at_once(planted, tmp_path):
    """A rank's result planted as a link to a FIFO held the grader in open() for good; to /dev/zero it read
    without end. The grader's reader opens without following links or blocking, and reads a capped regular file."""
    from toolkit.grading import session, wire

    path = tmp_path / "check-0-rank-0.json"
    if "FIFO" in planted:
        os.mkfifo(tmp_path / "fifo")
    if planted == "a link to a FIFO":
        path.symlink_to(tmp_path / "fifo")
    elif planted == "a FIFO":
        os.mkfifo(path)
    elif planted == "a link to /dev/zero":
        path.symlink_to("/dev/zero")
    else:
        with open(path, "wb") as f:
            f.truncate(wire.MAX_BYTES + 1)  # sparse: costs no disk
    found = []
    reader = threading.Thread(target=lambda: found.append(session._read(path)), daemon=True)
    started = time.monotonic()
    reader.start()
    reader.join(timeout=10)
    assert found, f"the grader's reader was still in {planted} after 10 s"
    assert time.monotonic() - started < 5 and "cannot read" in found[0]["error"], found


@pytest.mark.timeout(300)
def test_run_autograder_refuses_a_submission_that_is_a_link(lab, tmp_path):
    """Gradescope's run_autograder graded a submitted link to the lab's solution.py: 14/14 on lab 10."""
    import subprocess
    import sys

    root = tmp_path / "autograder"
    (root / "source" / "labs").mkdir(parents=True)
    (root / "submission").mkdir()
    (root / "source" / "labs" / "lab").symlink_to(lab)
    (root / "source" / "LAB").write_text("lab\n")
    (root / "submission" / "skeleton.py").symlink_to(lab / "solution.py")
    env = dict(os.environ, AUTOGRADER_ROOT=str(root), PYTHON=sys.executable)
    done = subprocess.run(
        [str(LABS / "autograder" / "run_autograder")], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr
    results = json.loads((root / "results" / "results.json").read_text())
    assert results["score"] == 0 and "is a link" in results["output"], results


# --- the students' build -----------------------------------------------------------------------------------------
DOORS = {
    "toolkit.comm.use('ring'), then the toolkit's collective": """
import toolkit

def summed(x, group):
    toolkit.comm.use("r" + "ing")          # a name the grader's scan cannot read
    try:
        toolkit.comm.all_reduce(x, group=group)
    finally:
        toolkit.comm.use("backend")
""",
    "the original function taken out of the delegation watcher's closure": """
import importlib
import torch.distributed as dist

def summed(x, group):
    watched = getattr(importlib.import_module("toolkit.comm." + "ri" + "ng"), "all_" + "reduce")
    original = next(c.cell_contents for c in watched.__closure__ if callable(c.cell_contents))
    original(x, dist.ReduceOp.SUM, group)
""",
}


@pytest.mark.timeout(300)
@AT_SCALE  # the students' build is in every grading of the suite; the captured built-ins' test runs on it
@pytest.mark.parametrize("door", list(DOORS), ids=["comm.use", "closure"])
def test_no_door_of_the_toolkit_leads_to_the_answer(door, lab, tmp_path, no_leftover_ranks):
    """The ranks import the toolkit with the lab's answers taken out: both scored full marks on lab 01 (the ring
    reached through toolkit.comm's door, or out of the watcher's closure); now there is no ring to reach."""
    from test_grading_attacks import CHECKS as ONE
    from test_grading_attacks import SUMMED

    (lab / "checks.py").write_text(ONE + SUMMED)
    score = grade(lab, _submission(tmp_path, "def total(xs):\n    return xs.sum()\n" + DOORS[door]))
    summed = next(r for r in score.results if r.name == "the sum over two ranks")
    assert summed.earned == 0 and "toolkit.comm.ring" in summed.message, format_score(score)
    assert "not in the students' toolkit" in summed.message or "toolkit's own implementation" in summed.message
    assert score.results[0].passed, format_score(score)  # the rest of the file is graded as it is


# --- limits from outside the submission ------------------------------------------------------------------------
@AT_SCALE
@pytest.mark.timeout(300)
def test_a_patched_watchdog_does_not_buy_time(lab, tmp_path, no_leftover_ranks):
    """The rank's watchdog lives in the submission's process: patched, a 40 s sleep at import ran 40 s under
    --time-limit 3. The grader's overseer stops it from outside."""
    attack = """
import sys, time
watchdog = sys.modules["toolkit.grading.watchdog"]
watchdog.Watchdog._over_time = lambda self, index: None
watchdog.Watchdog._check_everyone = lambda self, index: None
time.sleep(40)
"""
    started = time.monotonic()
    score = grade(lab, _submission(tmp_path, attack), limits=Limits(time_limit_s=3, stall_s=2))
    elapsed = time.monotonic() - started
    message = score.results[0].message
    assert score.total == 0 and "still importing your file after more than 3 s" in message, message
    assert "stopped by the grader" in message, message  # not the rank's (switched off): the overseer's
    print(f"stopped after {elapsed:.1f} s of grading (the sleep: 40 s)")


@AT_SCALE
@pytest.mark.timeout(300)
def test_what_the_ranks_print_is_capped(lab, tmp_path, no_leftover_ranks):
    """48 MiB printed per rank made a 101 MB launch log; the grader reads the ranks' output through a pipe only it
    holds and stops the launch past the output limit."""
    from test_grading_attacks import CHECKS as ONE
    from test_grading_attacks import SUMMED

    (lab / "checks.py").write_text(ONE + SUMMED)
    attack = """
import sys
line = "x" * 1023 + "\\n"
for _ in range(48 * 1024):
    sys.stdout.write(line)
"""
    score = grade(lab, _submission(tmp_path, attack))
    message = score.results[0].message
    assert score.total == 0 and "printed more than 8 MiB (the grader's limit on output)" in message, message


# --- a rank sees nothing of the grader -------------------------------------------------------------------------
LOOKS_AROUND = """
import json, os, resource
seen = {"uid": os.getuid(), "secrets": [], "pids": [],
        "shm": sorted(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else []}
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            seen["pids"].append(open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\\0", b" ").decode()[:300])
        except OSError:
            pass
        for what in ("environ", "cmdline"):
            try:
                if b"SECRET-7e1" in open(f"/proc/{pid}/{what}", "rb").read():
                    seen["secrets"].append(f"/proc/{pid}/{what}")
            except OSError:
                pass
try:
    open("/dev/shm/left-by-an-earlier-grading", "w").write("hello")
except OSError as exc:
    seen["shm_write"] = type(exc).__name__
for kind in ("RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_DATA"):
    soft, hard = resource.getrlimit(getattr(resource, kind))
    try:
        resource.setrlimit(getattr(resource, kind), (hard + 1 if hard >= 0 else hard, hard + 1 if hard >= 0 else hard))
        seen[kind] = "raised"
    except (ValueError, OSError):
        seen[kind] = hard
raise RuntimeError("SEEN " + json.dumps(seen))
"""


@pytest.mark.timeout(300)
def test_a_rank_sees_nothing_of_the_grader(lab, tmp_path):
    """A rank read /proc/<pid>/environ and cmdline of the grader and of every process above it (an instructor's
    secrets), ran as root where the interpreter lay under /root, and left files in /dev/shm that the next grading
    read. Two gradings, by a grader whose environment holds a secret: neither rank finds it, nor the other's file,
    nor a process outside its launch; its limits cannot be raised."""
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "toolkit",
            "grade",
            str(lab),
            "--solution",
            str(_submission(tmp_path, LOOKS_AROUND)),
            "--format",
            "json",
            "--quiet",
        ],
        env=dict(os.environ, INSTRUCTOR_TOKEN="SECRET-7e1"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    report = json.loads(done.stdout)
    messages = [report["checks"][0]["message"], grade(lab, _submission(tmp_path, LOOKS_AROUND)).results[0].message]
    assert all("SEEN " in m for m in messages), messages
    seen = [json.loads(m.split("SEEN ", 1)[1].splitlines()[0]) for m in messages]
    for looked in seen:
        assert looked["secrets"] == [], looked
        assert "left-by-an-earlier-grading" not in looked["shm"], looked
        assert all(isinstance(looked[k], int) for k in ("RLIMIT_CPU", "RLIMIT_FSIZE")), looked  # hard: not raised
        if os.geteuid() == 0:
            assert looked["uid"] != 0, looked
    if "its own PID namespace" in report["sandbox"]:  # the launch's processes only: not the grader, not pytest
        assert not [c for c in seen[0]["pids"] + seen[1]["pids"] if "pytest" in c or "toolkit grade" in c], seen


# --- never silently as root --------------------------------------------------------------------------------------
def test_an_unreachable_interpreter_stops_the_grading_with_what_to_change(tmp_path):
    """Where the sandbox's user cannot enter the interpreter's folder (a Python under /root) and no mount namespace
    can make it reachable, nothing is run; where one can, the grading goes on (the folder is covered with only
    the interpreter in it)."""
    from toolkit.grading import namespaces, sandbox

    home = tmp_path / "home"
    (home / "python" / "bin").mkdir(parents=True)
    home.chmod(0o700)
    stranger = (os.getuid() + 12345, os.getgid() + 12345)  # anyone but the folder's owner
    barrier = next(iter(namespaces.blocked([str(home / "python")], stranger)))  # home, or a 0700 folder above it
    assert str(home).startswith(barrier)
    with pytest.raises(sandbox.Unsafe) as refused:
        sandbox.preflight(stranger, [str(home / "python")], made=[])
    said = str(refused.value)
    assert f"cannot enter {barrier}" in said and "Nothing was run" in said and f"chmod o+x {barrier}" in said, said
    assert "TOOLKIT_GRADING_USER" in said and "/usr, /opt" in said, said
    sandbox.preflight(stranger, [str(home / "python")], made=["its own PID namespace"])  # made reachable: goes on
    sandbox.preflight(None, [str(home / "python")], made=[])  # not root: the submission runs as the grader's user


@pytest.mark.skipif(os.geteuid() != 0, reason="the unprivileged user exists only when grading as root")
def test_as_root_the_command_line_refuses_rather_than_run_a_submission_as_root(lab, tmp_path, monkeypatch, capsys):
    """Grading as root with the interpreter out of `nobody`'s reach ran every rank as root, silently."""
    from toolkit.grading import namespaces, sandbox

    home = tmp_path / "root-only"
    home.mkdir(mode=0o700)
    monkeypatch.setattr(sandbox, "python_paths", lambda: [str(home)])
    monkeypatch.setattr(namespaces, "_probed", [[]])  # as on a machine that allows no namespace
    results = tmp_path / "results.json"
    assert main([str(lab), "--format", "gradescope", "--output", str(results)]) == 3
    said = capsys.readouterr().err
    assert "rather than run the submission as root" in said and "Nothing was run" in said, said
    assert json.loads(results.read_text())["score"] == 0


# --- what a rank can touch: a point-to-point lab's messages -----------------------------------------------------
MESSAGES_TASK = """

def exchanged(student, rank, given):
    with rank.messages() as messages:
        x = given["x"].clone()
        student.summed(x, rank.group)
    return {"x": x, "messages": messages}
"""

MESSAGES_CHECK = """
MESSAGES_ONLY = True

@check("the sum over two ranks, one message each way", points=1, world_sizes=(2,), task="exchanged",
       inputs=lambda n, g: [{"x": torch.randn(4, generator=g)} for _ in range(n)])
def exchanged(ctx, given, got):
    for r in range(2):
        ctx.expect(got[r]["x"], given[0]["x"] + given[1]["x"], "the sum", rank=r, exact=False)
        if sorted(map(tuple, got[r]["messages"])) != [("recv", 1 - r, 4), ("send", 1 - r, 4)]:
            ctx.fail(f"rank {r} posted {got[r]['messages']}: one send and one receive of 4 elements")
"""

BY_MESSAGES = """
import torch, torch.distributed as dist

def summed(x, group):
    peer = 1 - dist.get_rank()
    other = torch.empty_like(x)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer, group),
                                        dist.P2POp(dist.irecv, other, peer, group)]):
        work.wait()
    x.add_(other)
"""

CAPTURED = """
import torch, torch.distributed as dist
ALL_REDUCE = dist.all_reduce          # captured at import, before any task switches it off

def summed(x, group):                 # decoys of the size the traffic check counts, then the built-in
    peer = 1 - dist.get_rank()
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.zeros(4), peer, group),
                                        dist.P2POp(dist.irecv, torch.zeros(4), peer, group)]):
        work.wait()
    ALL_REDUCE(x, group=group)
"""

FORGED = BY_MESSAGES.replace(
    "    x.add_(other)",
    """    x.add_(other)
    dist.send(x, peer, group) if dist.get_rank() == 0 else dist.recv(torch.empty_like(x), peer, group)  # one more

import contextlib, sys
@contextlib.contextmanager
def forged(self):                     # the record the task returns, rewritten to show exactly the ring's messages
    log = []
    yield log
    log[:] = [["send", 1 - self.rank, 4], ["recv", 1 - self.rank, 4]]
sys.modules["toolkit.grading.on_rank"].Rank.messages = forged
""",
)


NEW_CHANNELS = BY_MESSAGES.replace(
    "    x.add_(other)",
    """    x.add_(other)
    import os, socket
    tried = {}
    for name, make in (("udp", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM)),
                       ("unix pair", socket.socketpair),
                       ("the launch's store", lambda: dist.TCPStore(
                           "127.0.0.1", int(os.environ["TOOLKIT_STORE_PORT"]), 2, False,
                           timeout=__import__("datetime").timedelta(seconds=2))),
                       ("a gloo group", lambda: dist.new_group([0, 1], backend="gloo"))):
        try:
            make()
            tried[name] = "opened"
        except Exception as exc:
            tried[name] = type(exc).__name__
    if "opened" in tried.values():
        raise RuntimeError(f"a channel: {tried}")
""",
)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "attack",
    [
        "built-ins captured at import, with decoys",
        pytest.param("a forged record of messages", marks=AT_SCALE),
        pytest.param("a channel of its own", marks=AT_SCALE),
    ],
)
def test_a_point_to_point_labs_traffic_is_what_the_grader_carried(attack, lab, tmp_path, no_leftover_ranks):
    """The issue's lab 01 attack (13/13): the built-in collective captured at import, before the task switched it
    off, behind decoy neighbour traffic of the size the check counts; and a record of messages rewritten in the
    rank. In a MESSAGES_ONLY lab the ranks have no process group with a collective, and the grader judges the
    messages its relay carried. The honest submission still passes."""
    from test_grading_attacks import CHECKS as ONE

    (lab / "tasks.py").write_text(TASKS + MESSAGES_TASK)
    (lab / "checks.py").write_text(ONE + MESSAGES_CHECK)
    if attack.startswith("built-ins"):
        honest = grade(lab, _submission(tmp_path, BY_MESSAGES, "honest.py"))
        assert honest.results[1].passed, format_score(honest)
    if attack == "a channel of its own":  # every attempt refused: the honest exchange still scores
        score = grade(lab, _submission(tmp_path, NEW_CHANNELS))
        assert score.results[1].passed, format_score(score)
        return
    cheat = CAPTURED if attack.startswith("built-ins") else FORGED
    score = grade(lab, _submission(tmp_path, cheat))
    message = score.results[1].message
    assert score.results[1].earned == 0, format_score(score)
    assert (
        "the built-in collective allreduce is not allowed here" in message
        if attack.startswith("built-ins")
        else "rank 0 posted [['send', 1, 4], ['recv', 1, 4], ['send', 1, 4]]" in message
    ), message


LAB01_CAPTURED = """
import torch
import torch.distributed as dist

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER = dist.all_reduce, dist.all_gather_into_tensor, dist.reduce_scatter_tensor


def _decoys(tensor, group, steps):
    n, r = dist.get_world_size(group), dist.get_rank(group)
    right, left = dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)
    for _ in range(steps):
        chunk = torch.zeros(tensor.numel() // n, dtype=tensor.dtype)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, chunk, right, group),
                                            dist.P2POp(dist.irecv, chunk.clone(), left, group)]):
            work.wait()


def reduce_scatter(output, input, op, group=None, async_op=False):
    REDUCE_SCATTER(output, input, op=op, group=group)


def all_gather(output, input, group=None, async_op=False):
    ALL_GATHER(output.view(-1), input.reshape(-1), group=group)


def all_reduce(tensor, op, group=None, async_op=False):
    if dist.get_world_size(group) > 1:
        _decoys(tensor, group, 2 * (dist.get_world_size(group) - 1))
    ALL_REDUCE(tensor, op=op, group=group)
"""


@AT_SCALE
@pytest.mark.timeout(600)
def test_lab01_built_ins_captured_at_import_score_nothing(tmp_path, no_leftover_ranks):
    """Issue 29's lab 01 attack, as it was written: 13/13 before; no built-in collective exists in a rank of lab 01
    now, so every check fails, saying why."""
    path = tmp_path / "captured.py"
    path.write_text(LAB01_CAPTURED)
    score = grade(LABS / "01-ring-allreduce", path)
    traffic = next(r for r in score.results if r.name.startswith("a real ring"))
    assert score.total == 0, format_score(score)
    assert "the built-in collective allreduce is not allowed here" in traffic.message, traffic.message


@pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox runs as another user only when grading as root")
def test_without_namespaces_what_the_sandbox_user_left_in_shared_folders_is_removed(tmp_path):
    """Where a launch has no /tmp and /dev/shm of its own, a file left there by the sandbox's user is a channel to
    the next grading: it is removed after the grading (and only what that user owns)."""
    from toolkit.grading import sandbox

    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "left").write_text("for the next grading")
    (shm / "kept").write_text("the machine's own")
    (shm / "folder").mkdir()
    for name in ("left", "folder"):
        os.chown(shm / name, 65534, 65534)
    assert sorted(Path(p).name for p in sandbox.sweep((65534, 65534), [str(shm)])) == ["folder", "left"]
    assert [p.name for p in shm.iterdir()] == ["kept"]


def test_a_covered_tmp_keeps_the_box_and_the_ranks_python_environment_not_the_working_folder(tmp_path):
    """A clone under /tmp: its .venv and a site-packages a .pth names (by name and resolved) stay visible to the
    ranks under the private /tmp; the working folder on sys.path does not."""
    from toolkit.grading.namespaces import kept

    venv, other = tmp_path / "clone" / ".venv", tmp_path / "project" / ".venv"
    packages = other / "lib" / "python3" / "site-packages"
    packages.mkdir(parents=True)
    venv.parent.mkdir()
    venv.symlink_to(other)
    work = tmp_path / "clone"
    found = kept(str(tmp_path / "box"), str(venv), str(venv), [str(work), str(venv / "lib/python3/site-packages")])
    assert str(tmp_path / "box") in found
    assert {str(venv), str(other), str(venv / "lib/python3/site-packages"), str(packages)} <= set(found)
    assert str(work) not in found
