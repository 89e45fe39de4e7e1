"""When a rank fails under `launch`, the rank that caused it is named first; clear messages.

The judging itself (`toolkit.runtime.blame`) is tested on hand-made evidence, without processes; each
case the issue lists is then run once for real, at world 3. Failures in training state (checkpoints, a
NaN loss): test_failures_training.py; under mpiexec: test_failures_outside.py.
"""

import os
import signal
import sys
import threading
import time

import pytest
import torch

import toolkit
from toolkit import comm
from toolkit.runtime import RankError, blame, status
from toolkit.runtime.status import FAILED, IDLE, INSIDE, Entry, StatusBoard

pytestmark = pytest.mark.timeout(120)
WORLD = (0, 1, 2)


# --- judging, on hand-made evidence -------------------------------------------------------------------
def _board(tmp_path, rank, state, entry=None, counts=None, since=0.0):
    """A real board file, written as a rank would, read back as the launcher does."""
    board = StatusBoard(str(tmp_path / f"board-{rank}"), create=True)
    for group, entered in (counts or {}).items():
        board.count(status.key(group), entered)
    board.post(state, entry, since)
    snapshot = board.read()
    board.close()
    return snapshot


def _error(message, consequence, at=100.0, kind="RuntimeError"):
    return {
        "type": kind,
        "message": message,
        "time": at,
        "traceback": f"Traceback: {kind}: {message}",
        "consequence": consequence,
    }


def test_the_board_reads_back_what_a_rank_posted(tmp_path):
    entry = Entry("all_reduce", WORLD, 7, "phase 'forward', 12 x float32")
    snap = _board(tmp_path, 0, INSIDE, entry, {WORLD: 7, (0, 1): 2}, since=123.0)
    assert (snap.state, snap.since, snap.entry) == (INSIDE, 123.0, entry)
    assert snap.entered(WORLD) == 7 and snap.entered((0, 1)) == 2 and snap.entered((1, 2)) == 0
    assert entry.describe() == "all_reduce #7 (group [0, 1, 2]) (phase 'forward', 12 x float32)"
    assert Entry("send", (0, 2), 3).label() == "send #3 (ranks [0, 2])"


def test_a_rank_descheduled_half_way_through_a_post_is_never_read_torn(tmp_path):
    """A rank writes its slot field by field; on a loaded machine it can stop between the state and the time.
    A launcher that read then saw "inside since 1970" and blamed a hang of 1.8e9 s on a healthy rank (seen
    in CI). The reader must wait for the post to finish and see it whole."""
    path = str(tmp_path / "board-1")
    writer, reader = StatusBoard(path, create=True), StatusBoard(path)
    writer.post(IDLE, Entry("all_reduce", (0, 1), 23))
    entry, half_way, go_on = Entry("all_reduce", (0, 1), 24), threading.Event(), threading.Event()

    def post_slowly():
        with writer._writing():
            writer._map[status._HEAD_AT] = INSIDE  # the state is out, the time and number not yet
            half_way.set()
            go_on.wait(5)
            status._HEAD.pack_into(writer._map, status._HEAD_AT, INSIDE, 1234.5, 24, status.key((0, 1)))

    thread = threading.Thread(target=post_slowly)
    thread.start()
    assert half_way.wait(5)
    threading.Timer(0.05, go_on.set).start()
    snap = reader.read()
    thread.join(5)
    assert (snap.state, snap.since, snap.entry.number) == (INSIDE, 1234.5, 24)
    assert snap.entry.label() == entry.label()
    writer.close(), reader.close()


def test_a_death_is_named_before_the_errors_it_caused(tmp_path):
    failed = Entry("all_reduce", WORLD, 2, "")
    evidence = [
        blame.Evidence(0, _board(tmp_path, 0, FAILED, failed, {WORLD: 2}), _error("lost a partner", True, 100.0)),
        blame.Evidence(1, _board(tmp_path, 1, FAILED, failed, {WORLD: 2})),  # its error not written yet
        blame.Evidence(
            2,
            _board(tmp_path, 2, IDLE, Entry("all_reduce", WORLD, 1), {WORLD: 1}),
            code=-signal.SIGKILL,
            ended_at=100.5,
        ),
    ]
    verdict = blame.judge(evidence, now=101.0, timeout_s=30)
    assert verdict.found_cause and verdict.rank == 2
    text = verdict.message()
    assert text.startswith("rank 2 died: killed by SIGKILL (9)") and "out-of-memory" in text
    assert "consequences" in text and "  - rank 0: lost a partner" in text
    assert "  rank 0: failed in all_reduce #2 (group [0, 1, 2]); failed because another rank did" in text


@pytest.mark.parametrize("gloo_timed_out_first", [False, True])
def test_a_skipped_collective_blames_the_rank_that_never_entered_it(tmp_path, gloo_timed_out_first):
    waited = Entry("all_reduce", WORLD, 4, "phase 'idle', 3 x float32")
    state = FAILED if gloo_timed_out_first else INSIDE  # the launcher's check or the backend's timeout came first
    error = _error("timed out", True) if gloo_timed_out_first else None
    evidence = [
        blame.Evidence(0, _board(tmp_path, 0, state, waited, {WORLD: 4}, since=90.0), error),
        blame.Evidence(1, _board(tmp_path, 1, IDLE, Entry("all_reduce", WORLD, 3), {WORLD: 3})),
        blame.Evidence(2, _board(tmp_path, 2, state, waited, {WORLD: 4}, since=99.5), error),
    ]  # came late
    verdict = blame.judge(evidence, now=101.0, timeout_s=10)
    assert verdict.rank == 1
    assert verdict.headline.startswith("rank 1 did not enter all_reduce #4 (group [0, 1, 2]): ranks 0, 2 waited")
    assert "rank 1: not in a collective (last entered: all_reduce #3 (group [0, 1, 2]))" in verdict.message()
    if not gloo_timed_out_first:  # before timeout_s nothing is wrong yet
        assert blame.judge(evidence, now=95.0, timeout_s=10) is None


def test_one_extra_call_or_a_mismatched_one_blames_the_odd_rank(tmp_path):
    extra = Entry("all_reduce", WORLD, 5)
    evidence = [
        blame.Evidence(0, _board(tmp_path, 0, IDLE, Entry("all_reduce", WORLD, 4), {WORLD: 4})),
        blame.Evidence(1, _board(tmp_path, 1, INSIDE, extra, {WORLD: 5}, since=0.0)),
        blame.Evidence(2, _board(tmp_path, 2, IDLE, Entry("all_reduce", WORLD, 4), {WORLD: 4})),
    ]
    verdict = blame.judge(evidence, now=100.0, timeout_s=10)
    assert (
        verdict.rank == 1
        and "rank 1 entered all_reduce #5 (group [0, 1, 2]) but ranks [0, 2] never did" in verdict.headline
    )
    mismatch = [
        blame.Evidence(r, _board(tmp_path, r, INSIDE, Entry(op, WORLD, 4), {WORLD: 4}, since=0.0))
        for r, op in enumerate(("all_reduce", "broadcast", "all_reduce"))
    ]
    verdict = blame.judge(mismatch, now=100.0, timeout_s=10)
    assert verdict.rank == 1 and verdict.headline.startswith("rank 1 called broadcast #4 (group [0, 1, 2]) where")


def test_a_raise_is_the_cause_and_identical_raises_are_grouped(tmp_path):
    same = [blame.Evidence(r, None, _error("bad config", False, 100.0 + r, "ValueError")) for r in range(3)]
    verdict = blame.judge(same, now=101.0, timeout_s=10)
    assert verdict.rank == 0 and verdict.headline == "rank 0 raised ValueError: bad config"
    assert "(ranks 1, 2 failed the same way)" in verdict.message() and "traceback of rank 0" in verdict.message()
    echoes = [blame.Evidence(0, None, _error("lost a partner", True))]
    assert blame.judge(echoes, now=101.0, timeout_s=10).found_cause is False  # wait a moment for the cause


def test_consequences_are_recognised_through_the_chain():
    class LoadElsewhere(blame.Consequence, ValueError):
        pass

    assert blame.is_consequence(LoadElsewhere("rank 1 could not load"))
    try:
        try:
            raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234")
        except RuntimeError as exc:
            raise ValueError("my own wrapper") from exc
    except ValueError as wrapped:
        assert blame.is_consequence(wrapped)
    assert not blame.is_consequence(ValueError("rank one is unhappy"))


# --- messages that say what was wrong and what to do -----------------------------------------------------
def test_moe_names_a_wrong_input_dtype():
    layer = toolkit.moe.MoE(8, 16, 4)
    with pytest.raises(
        TypeError,
        match=r"expects torch.float32 tokens.*got torch.int64: token ids go through an "
        r"embedding first",
    ):
        layer(torch.arange(16).reshape(2, 8))
    with pytest.raises(TypeError, match=r"got torch.float64: convert one to the other: x.to\(torch.float32\)"):
        layer(torch.randn(2, 8, dtype=torch.float64))


def test_an_unpicklable_function_says_what_cannot_travel_and_what_to_do():
    lock = threading.Lock()

    def uses_lock():
        with lock:
            return 1

    with pytest.raises(TypeError) as info:
        toolkit.launch(uses_lock, 2, timeout_s=10)
    message = str(info.value)
    assert "by value (cloudpickle)" in message and "the variable `lock` it closes over, a lock" in message
    assert "inside the function, on each rank" in message


# --- each case for real, at world 3 ----------------------------------------------------------------------
def _dies_inside_a_collective(how, folder):
    import torch.distributed as dist

    comm.all_reduce(torch.ones(3))
    if dist.get_rank() == 2:
        time.sleep(1.0)  # the others are waiting in all_reduce #2 by now
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)
    comm.all_reduce(torch.ones(3))
    time.sleep(60)


@pytest.mark.parametrize(
    "how, story", [("kill", "rank 2 died: killed by SIGKILL (9)"), ("exit", "rank 2 died with exit code 3")]
)
def test_a_rank_that_dies_inside_a_collective_is_named_not_its_peers(how, story, tmp_path, no_leftover_ranks):
    with pytest.raises(RankError) as info:
        # surfaced at once: a launch that waited for the peers' collective to time out would outlast the test
        toolkit.launch(_dies_inside_a_collective, 3, args=(how, str(tmp_path)), timeout_s=3600, quiet=True)
    message = str(info.value)
    assert info.value.rank == 2 and message.startswith(story), message
    for peer in (0, 1):  # a peer is listed as a consequence, or (starved on a loaded machine) still waiting
        listed = f"  - rank {peer}: all_reduce #2 (group [0, 1, 2])" in message
        assert listed or f"  rank {peer}: in all_reduce #2 (group [0, 1, 2])" in message, message
        assert not listed or f"  rank {peer}: failed in all_reduce #2 (group [0, 1, 2])" in message, message
    assert "  rank 2: not in a collective (last entered: all_reduce #1 (group [0, 1, 2])" in message


def _ended(pid):
    try:
        zombie = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
        return zombie and os.listdir(f"/proc/{pid}/task") == [str(pid)]
    except OSError:  # reaped
        return True


def _killed_then_another_raises(folder):
    import torch.distributed as dist

    rank = dist.get_rank()
    with open(os.path.join(folder, f"pid-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    comm.barrier()
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 1:  # raise 50 ms after rank 2 has ended: every thread of it gone, reaped or not (its first thread
        # shows "Z" earlier, while gloo's and OpenMP's threads are still exiting: 100 ms under load)
        pid = int(open(os.path.join(folder, "pid-2")).read())
        while not _ended(pid):
            time.sleep(0.002)
        time.sleep(0.05)
        raise ValueError("rank one raises 50 ms after rank 2 died")
    time.sleep(60)


def test_blame_goes_by_when_things_happened_not_when_the_launcher_saw_them(tmp_path, monkeypatch, no_leftover_ranks):
    """A loaded machine delays the launcher's look at the ranks (3 of 3 runs at load ~5 blamed the raiser):
    the look is delayed here on purpose, by a second each time. A death must still be dated when it
    happened, so the SIGKILL 50 ms before the raise is the cause."""
    launching = sys.modules["toolkit.runtime.launch"]

    looked = launching._evidence

    def late_look(*args, **kwargs):
        time.sleep(1.0)
        return looked(*args, **kwargs)

    monkeypatch.setattr(launching, "_evidence", late_look)
    with pytest.raises(RankError) as info:
        toolkit.launch(_killed_then_another_raises, 3, args=(str(tmp_path),), timeout_s=60, quiet=True)
    message = str(info.value)
    assert info.value.rank == 2 and message.startswith("rank 2 died: killed by SIGKILL (9)"), message
    assert "also on its own: rank 1 raised ValueError: rank one raises 50 ms after rank 2 died" in message


def _skips_one(raw):
    import torch.distributed as dist

    reduce = dist.all_reduce if raw else comm.all_reduce
    for _ in range(3):
        reduce(torch.ones(3))
    if dist.get_rank() != 1:
        reduce(torch.ones(3))  # rank 1 skips this one: it is all_reduce #4 on the world group
    time.sleep(60)


@pytest.mark.parametrize("raw", [False, True], ids=["toolkit.comm", "torch.distributed"])
def test_a_skipped_collective_names_the_rank_that_skipped_it(raw, no_leftover_ranks):
    with pytest.raises(RankError) as info:
        toolkit.launch(_skips_one, 3, args=(raw,), timeout_s=2, quiet=True)
    message = str(info.value)
    assert info.value.rank == 1
    assert message.startswith("rank 1 did not enter all_reduce #4 (group [0, 1, 2]): ranks 0, 2 waited"), message
    assert "  rank 0: in all_reduce #4 (group [0, 1, 2])" in message and "  rank 2: in all_reduce #4" in message
    assert "  rank 1: not in a collective (last entered: all_reduce #3 (group [0, 1, 2])" in message
    assert ("raw torch.distributed" in message) == raw


def _one_rank_computes_on():
    import torch.distributed as dist

    comm.all_reduce(torch.ones(3))
    if dist.get_rank() == 1:
        _crunch()  # never reaches the next all_reduce
    comm.all_reduce(torch.ones(3))


def _crunch():
    x = torch.ones(64, 64)
    while True:
        x = torch.tanh(x @ x)  # the line rank 1 is stuck on


def test_a_rank_stuck_in_compute_is_shown_where_it_is(no_leftover_ranks):
    """The rank is named (it never entered all_reduce #2); its Python stack says what it does instead."""
    with pytest.raises(RankError) as info:
        toolkit.launch(_one_rank_computes_on, 3, timeout_s=2, quiet=True)
    message = str(info.value)
    assert info.value.rank == 1 and message.startswith("rank 1 did not enter all_reduce #2"), message
    stack = message.split("where rank 1 was when it was stopped (its Python stack, most recent call last):\n")[1]
    assert "in _one_rank_computes_on\n    _crunch()  # never reaches the next all_reduce" in stack, stack
    assert stack.rstrip().endswith("in _crunch\n    x = torch.tanh(x @ x)  # the line rank 1 is stuck on"), stack
    assert "where rank 0 was" not in message  # the waiting ranks are where the table says
