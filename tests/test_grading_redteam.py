"""A determined student against the rebuilt grader (issue 29, third trial): each test replays an attack on the
construction itself (the relay's record, the launch's import path, the ranks' toolkit and its PyTorch peers, the
channel, the reports), and guards what it found: failing before the fix where the attack broke the grade, and
kept where it held.

The cheap ones (no rank started, or one tiny grading) run in the suite; the rest carry `grading_scale`
(`make test-grading`)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import test_grading_attacks as tiny

from toolkit.grading import Limits, delegation, format_score, grade
from toolkit.grading.grader import lab_checks
from toolkit.grading.relay import Relay
from toolkit.grading.relay_group import read_frame, send_frame
from toolkit.grading.session import launcher_command

LABS = Path(__file__).resolve().parent.parent / "labs"
ROOT = LABS.parent
AT_SCALE = pytest.mark.grading_scale


@pytest.fixture
def tiny_lab(tmp_path):
    """test_grading_attacks' lab of two checks (a total on one rank, a sum over two)."""
    folder = tmp_path / "lab"
    folder.mkdir()
    for name, text in (("tasks", tiny.TASKS), ("checks", tiny.CHECKS + tiny.SUMMED), ("skeleton", tiny.SKELETON)):
        (folder / f"{name}.py").write_text(text)
    return folder


# --- the relay's record is what it carried ----------------------------------------------------------------------
def _rank(relay: Relay, rank: int) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(relay.path)
    send_frame(sock, {"op": "hello", "rank": rank, "token": relay.tokens[rank]})
    return sock


def _post(sock, op: str, peer: int, numel: int, payload: bytes = b"", id: int = 1) -> None:
    message = {"op": op, "peer": peer, "group": "", "tag": 0, "dtype": "float32", "numel": numel, "id": id}
    send_frame(sock, message, payload)


def test_the_relay_refuses_a_send_that_carries_more_than_it_declares(tmp_path):
    """Lab 01 scored the ring's traffic check (8/13 in all) with every rank passing its whole tensor around the
    ring, N - 1 times: frames written on the rank's own link to the relay declared a chunk's elements and carried
    the whole tensor, and the record said a chunk. A send's bytes must be exactly its elements'."""
    with Relay(str(tmp_path), 2, [0], {"0": [b"{}", b"{}"]}) as relay:
        zero, one = _rank(relay, 0), _rank(relay, 1)
        _post(zero, "send", 1, 1, b"\0" * 400)  # declares 1 float32 element, carries 100
        answer, _ = read_frame(zero, 1 << 20)
        assert "carried 400 bytes" in answer.get("error", ""), answer
        _post(one, "recv", 0, 1, id=2)
        _post(zero, "send", 1, 1, b"\1\0\0\0", id=3)  # declares one, carries one: delivered
        assert read_frame(one, 1 << 20) == ({"id": 2}, b"\1\0\0\0")
        assert read_frame(zero, 1 << 20) == ({"id": 3}, b"")
        record = {r: dict(relay.record[r]) for r in (0, 1)}
    assert record == {0: {"import": [["send", 1, 1]]}, 1: {"import": [["recv", 0, 1]]}}, record


# --- nothing the submission writes is imported by the launch ----------------------------------------------------
PLANTED = "import os\nopen(os.environ['PLANTED_MARK'], 'w').write('planted code ran as uid %d' % os.getuid())\n"


def test_a_fresh_launcher_imports_nothing_from_its_working_folder_or_home(tmp_path):
    """Where no fork server serves, each launch's launcher was `python -m toolkit.grading.launcher`, started as the
    grader (root on Gradescope) in the submission's working folder, before it entered the sandbox: a `toolkit/`
    package the submission wrote there at its first launch ran as root, outside any sandbox, at the next. The
    launcher is now an isolated interpreter (no working folder, no user site-packages, no PYTHON* variable on its
    path) importing the students' toolkit alone."""
    work = tmp_path / "work"
    (work / "toolkit").mkdir(parents=True)
    (work / "toolkit" / "__init__.py").write_text(PLANTED)
    site = work / ".local" / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    site.mkdir(parents=True)
    (site / "planted.pth").write_text(PLANTED.replace("\n", "; ").replace("import os; ", "import os; "))
    mark = tmp_path / "mark"
    env = {"PATH": os.environ["PATH"], "HOME": str(work), "PYTHONPATH": str(work), "PLANTED_MARK": str(mark)}
    done = subprocess.run(
        launcher_command(ROOT, tmp_path / "no-spec.json"), cwd=work, env=env, capture_output=True, timeout=120
    )
    assert not mark.exists(), mark.read_text()
    assert b"no-spec.json" in done.stderr, done.stderr[-2000:]  # the real launcher ran, and found no spec


def test_a_forked_rank_puts_no_working_folder_on_its_path(tmp_path):
    """Forked ranks recompute sys.path as `python -m` would: the working folder first. In a grading that folder is
    the submission's: a `toolkit/` written there at import replaced, from the next launch on, the rank's whole
    side of the grading (its sandbox's second layer, its memory limit, the relay, the watcher) before the
    submission was imported. The grading's environment says PYTHONSAFEPATH, and the runtime honours it."""
    code = (
        "import sys, os; sys.path.insert(0, sys.argv[1]); from toolkit.runtime import fresh_interpreter as fresh\n"
        "fresh.START.update(cwd=os.getcwd(), path=[os.getcwd()] + [p for p in sys.path if p], signals={})\n"
        "fresh._fresh_signals = lambda s: None\n"
        "fresh.become({'PYTHONSAFEPATH': '1', 'PYTHONPATH': sys.argv[1]}, sys.argv[2])\n"
        "assert sys.argv[2] not in sys.path and '' not in sys.path, sys.path\n"
        "fresh.become({'PYTHONPATH': sys.argv[1]}, sys.argv[2])\n"
        "assert sys.path[0] == sys.argv[2], sys.path  # toolkit.launch outside a grading: as python -m\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(ROOT), str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]


PLANT_AT_IMPORT = """
import json
import os
os.makedirs("toolkit", exist_ok=True)  # the working folder, which the next launch's ranks started in
with open("toolkit/__init__.py", "w") as f:
    f.write("raise RuntimeError('PLANTED: the rank imported the submission's toolkit before the submission')")

def total(xs):
    return xs.sum()

def summed(x, group):
    import torch.distributed as dist
    dist.all_reduce(x, group=group)
"""


@AT_SCALE
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fresh", [False, True], ids=["forked ranks", "fresh interpreters"])
def test_a_toolkit_planted_in_the_working_folder_is_never_imported(
    fresh, tiny_lab, tmp_path, monkeypatch, no_leftover_ranks
):
    """The attack above as a grading: before, the second launch's ranks (world size 2) imported the planted
    package and failed with its message; where no fork server serves, the launcher did too, as the grader."""
    if fresh:
        monkeypatch.setenv("TOOLKIT_LAUNCH_EXEC", "1")
    path = tmp_path / "plant.py"
    path.write_text(PLANT_AT_IMPORT)
    score = grade(tiny_lab, path)
    assert score.total == score.maximum == 3, format_score(score)


# --- PyTorch's own implementation of a lab's function -----------------------------------------------------------
PEERS = {
    "12-pipeline": (  # 7/7 before: PyTorch's 1F1B, given the warm-up
        "from toolkit.parallel.pipeline.schedules import Action\n"
        "from torch.distributed.pipelining.schedules import _get_1f1b_rank_ops, _ComputationType\n\n"
        "def one_f_one_b(pp, microbatches, rank, virtual_stages=1):\n"
        "    w = min(pp - 1 - rank, microbatches)\n"
        "    ops = _get_1f1b_rank_ops(1, pp, w, microbatches - w, w, rank, lambda s: rank, lambda s: rank)\n"
        "    forward = _ComputationType.FORWARD\n"
        "    return [Action('F' if o.computation_type == forward else 'B', o.microbatch_index, rank)\n"
        "            for o in ops if o is not None]\n"
    ),
    "04-moe-dispatch": (  # all_to_all's 2 points before: PyTorch's differentiable all-to-all
        "import torch.distributed.nn.functional as peers\n\n"
        "def all_to_all(x, out_splits, in_splits, group, label):\n"
        "    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))\n"
        "    return peers.all_to_all_single(out, x, list(out_splits), list(in_splits), group)\n"
    ),
    "13-context-parallel": (  # PyTorch's merge (0/2: it gives nan where a block saw no key; two lines mend that)
        "from torch.distributed.tensor.experimental._context_parallel._attention import _SDPAMerger\n\n"
        "def merge(out1, lse1, out2, lse2):\n"
        "    m = _SDPAMerger(False, 2)\n"
        "    m._merge_one(out1, lse1, False)\n"
        "    m._merge_one(out2, lse2, False)\n"
        "    return m._out.to(out1.dtype), m._lse.squeeze(-1).to(lse1.dtype)\n"
    ),
}


@pytest.mark.parametrize("name", list(PEERS))
def test_pytorchs_own_implementation_of_a_labs_function_scores_zero(name, tmp_path):
    """The students' toolkit has no answer left in it, but PyTorch ships some: lab 12 scored 7/7 from
    `torch.distributed.pipelining`'s 1F1B, lab 04's all-to-all check from `torch.distributed.nn.functional`'s.
    Each lab names them among its ANSWERS: the file is refused before any rank starts, saying why."""
    folder = LABS / name
    path = tmp_path / "skeleton.py"
    path.write_text((folder / "skeleton.py").read_text() + "\n" + PEERS[name])
    assert delegation.scan(path.read_text(), lab_checks(folder)[1]), f"{name}'s ANSWERS name no PyTorch peer"
    score = grade(folder, path)
    assert score.total == 0 and "PyTorch's" in score.results[0].message, format_score(score)


# --- what the grader itself reads: the source, the channel ------------------------------------------------------
@pytest.mark.parametrize(
    "source",
    ["x = a" + ".b" * 200_000 + "\n", "x = " + "+".join(["1"] * 300_000) + "\n", "x = " + "-" * 200_000 + "1\n"],
    ids=["attributes", "a sum", "signs"],
)
def test_a_file_too_deep_for_the_parser_fails_to_import_not_the_grader(source, tiny_lab, tmp_path):
    """Python's parser, in the grader's process, raised RecursionError or MemoryError on an expression nested a few
    hundred thousand deep: the grading crashed (exit 3, on Gradescope "tell the course staff") instead of scoring
    the file. Now it is the file's failure, said as such, and no rank starts."""
    path = tmp_path / "deep.py"
    path.write_text(source)
    score = grade(tiny_lab, path)
    assert score.total == 0 and "nested too deeply" in score.results[0].message, format_score(score)


CRAFTED = {
    "a tensor of 10^30 rows of nothing": {"__tensor__": "float32", "shape": [0, 10**30], "data": ""},
    "a tensor of 2^62 x 4 rows of nothing": {"__tensor__": "float32", "shape": [0, 2**62, 4], "data": ""},
    "a dict keyed by a dict": {"__pairs__": [[{"a": 1}, 1]]},
}


@pytest.mark.parametrize("name", list(CRAFTED))
def test_a_crafted_result_is_refused_as_one_never_raised_in_the_grader(name, tmp_path):
    """A result file a rank wrote with a tensor of shape [0, 10^30] passed every check of its form (no element, no
    byte) and raised TypeError in torch.empty, out of `wire.decode`: the grader crashed reading it. `decode` raises
    WireError and nothing else, and the launch's reader turns that into the check's failure."""
    from toolkit.grading import wire
    from toolkit.grading.session import _read

    raw = json.dumps(CRAFTED[name]).encode()
    with pytest.raises(wire.WireError):
        wire.decode(raw)
    (tmp_path / "result.json").write_bytes(raw)
    assert "cannot read" in _read(tmp_path / "result.json")["error"]


# --- what a person reads: Gradescope's page, the class's table --------------------------------------------------
def test_every_gradescope_output_is_declared_plain_text():
    """Gradescope renders an output in `simple_format` unless told otherwise, which lets some HTML through: an
    exception's text such as `<a href="https://evil.example">your full score</a>` became a link on the student's
    (and the TA's) page. Every output of results.json, the no-score one included, is declared text."""
    from toolkit.grading import CheckResult, Score
    from toolkit.grading.report import nothing_graded, render

    link = '<a href="https://evil.example">see your full score</a>'
    score = Score(
        lab="lab", solution="s.py", results=[CheckResult("c", 1, 0, link), CheckResult("h", 1, 0, link, True)]
    )
    written = json.loads(render(score, "gradescope"))
    assert written["output_format"] == written["test_output_format"] == "text"
    assert [t["output_format"] for t in written["tests"]] == ["text", "text"]
    assert json.loads(nothing_graded(link, "gradescope"))["output_format"] == "text"
    script = (ROOT / "labs" / "autograder" / "run_autograder").read_text()
    assert '"output_format": "text"' in script  # its own no-score file too


def test_a_class_tables_cells_are_never_formulas(tmp_path):
    """A student's file named `=HYPERLINK("https://evil.example","regrade")`.py became, in scores.csv, a formula a
    spreadsheet evaluates (a link, or worse, on the instructor's machine). A cell that starts like a formula is
    quoted; the name stays readable."""
    import csv

    from toolkit.grading.classroom import Row, write_csv

    name = '=HYPERLINK("https://evil.example","regrade")'
    path = tmp_path / "scores.csv"
    write_csv([Row(student=name, file=f"{name}.py", status="@SUM(1+1)", score=1, max_score=2)], path)
    row = list(csv.DictReader(path.open()))[0]
    assert row["student"] == "'" + name and row["file"] == f"'{name}.py" and row["status"] == "'@SUM(1+1)", row


# --- guards of what held ----------------------------------------------------------------------------------------
def test_nan_and_inf_never_pass_a_tolerance():
    """Held: a result of nan (every comparison false) or inf against `expect`, exact or within tolerances."""
    import torch

    from toolkit.grading.checks import CheckFailed, Judge

    expected = torch.tensor([1.0, 2.0])
    for got in (torch.tensor([float("nan"), 2.0]), torch.tensor([1.0, float("inf")])):
        for exact in (True, False):
            with pytest.raises(CheckFailed):
                Judge(2).expect(got, expected, "x", exact=exact)


def test_a_tensor_that_lies_about_comparisons_arrives_as_a_plain_tensor():
    """Held: a Tensor subclass whose __torch_function__ answers every comparison True (and whose __eq__ does) is
    encoded on the rank as dtype, shape and bytes; the grader gets a plain tensor that compares honestly."""
    import torch

    from toolkit.grading import wire

    class Liar(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func in (torch.Tensor.__eq__, torch.isclose, torch.allclose, torch.equal):
                return True
            return super().__torch_function__(func, types, args, kwargs or {})

    liar = torch.zeros(3).as_subclass(Liar)
    assert liar == torch.ones(3)  # on the rank, it lies
    got = wire.decode(wire.encode({"x": liar}))["x"]
    assert type(got) is torch.Tensor and not bool((got == torch.ones(3)).all())


def test_an_answer_of_millions_of_tiny_values_is_refused_before_it_is_built():
    """20 million empty lists fit in the 64 MiB an answer may hold and took about 1 GiB of the grader's memory once
    decoded, per rank and check of a launch, in the one process no limit covers. The channel counts values first."""
    from toolkit.grading import wire

    with pytest.raises(wire.WireError, match="values"):
        wire.decode(b"[" + b"[]," * 2_000_000 + b"[]]")
    assert wire.decode(wire.encode({"x": list(range(1000)), "t": __import__("torch").zeros(10**6)}))["x"][-1] == 999


@AT_SCALE
@pytest.mark.timeout(300)
def test_a_class_submission_named_like_the_toolkit_is_graded_not_run_by_the_grader(tiny_lab, tmp_path, monkeypatch):
    """Held: each student of a class is graded by `python -m toolkit grade`, whose first path entry is its working
    folder; a student's file named toolkit.py (or json.py) there would be imported by the grader itself, outside
    every sandbox. The copy lies one folder below: the file is graded as a submission."""
    from toolkit.grading.classroom import grade_class

    mark = tmp_path / "mark"
    monkeypatch.setenv("PLANTED_MARK", str(mark))
    (tmp_path / "class" / "alice").mkdir(parents=True)
    planted = PLANTED.replace("open(", "'PLANTED_MARK' in os.environ and open(")  # the ranks' environment lacks it
    (tmp_path / "class" / "alice" / "toolkit.py").write_text(planted + tiny.SOLUTION)
    rows = grade_class(tiny_lab, tmp_path / "class", tmp_path / "scores.csv", progress=False)
    assert not mark.exists(), mark.read_text()
    assert [(r.student, r.status, r.score) for r in rows] == [("alice", "graded", 3)], rows


# --- the time limit, timed by the grader ------------------------------------------------------------------------
def test_the_relays_record_of_phases_moves_only_with_what_it_handed_out_and_took_in(tmp_path):
    """The grader's clock of a launch (`Relay.progress`, which the overseer times): a rank's import is over once it
    took the first check's inputs, a check once it handed in its result, and the next inputs come only then."""
    with Relay(str(tmp_path), 2, [0, 1], {"0": [b"{}", b"{}"], "1": [b"{}", b"{}"]}) as relay:
        zero = _rank(relay, 0)
        assert relay.progress() == [0, 0]
        send_frame(zero, {"op": "inputs", "id": 1})
        assert read_frame(zero, 1 << 20) == ({"id": 1}, b"{}")
        send_frame(zero, {"op": "inputs", "id": 2})  # the next check's, before this one's result: refused
        assert "refused" in read_frame(zero, 1 << 20)[0]["error"]
        send_frame(zero, {"op": "result", "id": 3}, b"{}")
        read_frame(zero, 1 << 20)
        assert relay.progress() == [2, 0]


FAKED_PROGRESS = """
import os, sys, time
watchdog = sys.modules["toolkit.grading.watchdog"]  # the rank's own watchdog, switched off
watchdog.Watchdog._over_time = lambda self, index: None
watchdog.Watchdog._check_everyone = lambda self, index: None
out = os.path.join(os.path.dirname(os.getcwd()), "out")
for phase in ["import", 0, 1, 2]:  # a result file for each phase ahead, every few seconds: "progress"
    time.sleep(2)
    for rank in (0, 1):
        open(os.path.join(out, f"check-{phase}-rank-{rank}.json"), "w").write('{"error": "", "time": 0}')
time.sleep(40)
"""


@AT_SCALE
@pytest.mark.timeout(300)
def test_result_files_written_ahead_buy_no_time(tiny_lab, tmp_path, no_leftover_ranks):
    """The overseer timed each phase by the ranks' result files: files written ahead, one per phase every few
    seconds, stretched the import under --time-limit 3 to the launch's whole deadline (the first check then
    judged a forged file). It now times the phases by what the grader's relay handed out and took in."""
    path = tmp_path / "ahead.py"
    path.write_text(FAKED_PROGRESS + tiny.SOLUTION)
    score = grade(tiny_lab, path, limits=Limits(time_limit_s=3, stall_s=2))
    message = score.results[0].message
    assert score.total == 0 and "still importing your file after more than 3 s" in message, format_score(score)


FD_PROBE = """
import os, socket, struct
outside = []
for fd in map(int, os.listdir("/proc/self/fd")):
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        continue
    try:
        if s.family == socket.AF_UNIX:  # who is at the other end (pid 0: outside the launch's PID namespace)
            pid, uid, gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if (pid == 0 or uid != os.getuid()) and not str(s.getpeername()).endswith("relay.sock"):
                outside.append((fd, pid, uid, s.getpeername(), os.readlink(f"/proc/self/fd/{fd}")))
    finally:
        s.close()
assert not outside, outside
"""


@AT_SCALE
@pytest.mark.timeout(300)
def test_a_rank_holds_no_channel_to_the_grader_but_the_relay(tiny_lab, tmp_path, no_leftover_ranks):
    """Held: of every descriptor a rank inherits, the only one whose other end is outside the launch (another user,
    or a process its PID namespace does not show) is its link to the grader's relay, a channel of checked frames;
    none reaches the graders' fork server, the grading's server or the grader's files."""
    path = tmp_path / "fds.py"
    path.write_text(FD_PROBE + tiny.SOLUTION)
    score = grade(tiny_lab, path)
    assert score.total == score.maximum, format_score(score)


def test_the_relay_keeps_no_more_than_a_launchs_worth_of_messages(tmp_path, monkeypatch):
    """Every message a rank posts is kept in the grader's record (and a receive never matched, in its queue): a
    rank posting receives in a loop for a check's whole time limit grew the grader's memory by a gigabyte or more.
    Past MAX_POSTS a rank's posts are refused."""
    from toolkit.grading import relay as relay_module

    monkeypatch.setattr(relay_module, "MAX_POSTS", 5)
    with Relay(str(tmp_path), 2, [0], {"0": [b"{}", b"{}"]}) as relay:
        zero = _rank(relay, 0)
        for k in range(6):
            _post(zero, "recv", 1, 1, id=k)
        answer, _ = read_frame(zero, 1 << 20)
        assert "more than 5 messages" in answer.get("error", ""), answer
        assert sum(map(len, relay.record[0].values())) == 5


UNREADY = """
import glob, os
for path in glob.glob(os.path.join(os.path.dirname(os.getcwd()), "out", "ready-rank-*")):
    os.remove(path)  # the files that said the ranks got as far as the submission
os._exit(1)
"""


@pytest.mark.timeout(300)
def test_a_submission_cannot_pass_its_failure_off_as_the_graders(tiny_lab, tmp_path, no_leftover_ranks):
    """A submission that removed the ranks' ready files and ended at import made the grading raise "the ranks could
    not be started", and Gradescope's results.json told the student "the grader failed, not your code. Please tell
    the course staff." A rank says it is ready to the grader's relay, which alone keeps it: the file fails."""
    path = tmp_path / "unready.py"
    path.write_text(UNREADY)
    score = grade(tiny_lab, path)
    assert score.total == 0 and "your file does not import" in score.results[0].message, format_score(score)


@pytest.mark.timeout(300)
def test_a_rank_reaches_no_network_but_its_launchs_loopback(tiny_lab, tmp_path, no_leftover_ranks):
    """A rank connected to a port the grader's machine listened on (127.0.0.1): another grading's rendezvous store
    in a class graded with --jobs, a course's local service, the internet. Where the kernel allows it, the launch
    has a network of its own, a loopback only, over which its ranks still talk (gloo, their store)."""
    import threading

    from toolkit.grading import namespaces

    if namespaces.LOOPBACK_ONLY not in namespaces.probe():
        pytest.skip("this machine gives a launch no network namespace")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(60)
    reached = []

    def listen():
        try:
            reached.append(server.accept())
        except OSError:  # closed, or timed out: nobody came
            pass

    threading.Thread(target=listen, daemon=True).start()
    path = tmp_path / "reach.py"
    path.write_text(
        "import socket\ntry:\n"
        f"    socket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=3).sendall(b'hello')\n"
        "except OSError:\n    pass\n" + tiny.SOLUTION
    )
    score = grade(tiny_lab, path)
    server.close()
    assert not reached, "a rank connected to the grader's machine"
    assert score.total == score.maximum, format_score(score)  # the two ranks' gloo group works on its own loopback


def test_the_students_toolkits_built_for_other_labs_are_hidden_from_a_grading(tiny_lab, tmp_path, monkeypatch):
    """Every lab's students' toolkit keeps the other labs' answers (lab 01's keeps lab 12's 1F1B), and all are
    cached in one folder: where that folder lies under a tree the sandbox reads (TOOLKIT_STUDENT_CACHE=/opt/...),
    a rank read another lab's build for the answer. The whole cache is hidden; the ranks read their own copy."""
    from toolkit.grading import session, student_wheel

    cache = tmp_path / "opt" / "students"
    cache.mkdir(parents=True)
    monkeypatch.setattr(student_wheel, "CACHE", cache)
    with session.Box(tiny_lab, b"", "skeleton.py") as box:
        assert str(cache.resolve()) in session.hidden_from(box)
        assert not any(str(box.lib).startswith(h + "/") for h in session.hidden_from(box))
