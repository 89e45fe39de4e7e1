"""When a rank fails, the rank that caused it is named first, under launch and mpiexec; clear messages.

The judging itself (`toolkit.runtime.blame`) is tested on hand-made evidence, without processes; each
case the issue lists is then run once for real, at world 3.
"""
import os
import signal
import subprocess
import sys
import textwrap
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
    return {"type": kind, "message": message, "time": at, "traceback": f"Traceback: {kind}: {message}",
            "consequence": consequence}


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
        blame.Evidence(2, _board(tmp_path, 2, IDLE, Entry("all_reduce", WORLD, 1), {WORLD: 1}),
                       code=-signal.SIGKILL, ended_at=100.5),
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
    evidence = [blame.Evidence(0, _board(tmp_path, 0, state, waited, {WORLD: 4}, since=90.0), error),
                blame.Evidence(1, _board(tmp_path, 1, IDLE, Entry("all_reduce", WORLD, 3), {WORLD: 3})),
                blame.Evidence(2, _board(tmp_path, 2, state, waited, {WORLD: 4}, since=99.5), error)]  # came late
    verdict = blame.judge(evidence, now=101.0, timeout_s=10)
    assert verdict.rank == 1
    assert verdict.headline.startswith("rank 1 did not enter all_reduce #4 (group [0, 1, 2]): ranks 0, 2 waited")
    assert "rank 1: not in a collective (last entered: all_reduce #3 (group [0, 1, 2]))" in verdict.message()
    if not gloo_timed_out_first:  # before timeout_s nothing is wrong yet
        assert blame.judge(evidence, now=95.0, timeout_s=10) is None


def test_one_extra_call_or_a_mismatched_one_blames_the_odd_rank(tmp_path):
    extra = Entry("all_reduce", WORLD, 5)
    evidence = [blame.Evidence(0, _board(tmp_path, 0, IDLE, Entry("all_reduce", WORLD, 4), {WORLD: 4})),
                blame.Evidence(1, _board(tmp_path, 1, INSIDE, extra, {WORLD: 5}, since=0.0)),
                blame.Evidence(2, _board(tmp_path, 2, IDLE, Entry("all_reduce", WORLD, 4), {WORLD: 4}))]
    verdict = blame.judge(evidence, now=100.0, timeout_s=10)
    assert verdict.rank == 1 and "rank 1 entered all_reduce #5 (group [0, 1, 2]) but ranks [0, 2] never did" \
        in verdict.headline
    mismatch = [blame.Evidence(r, _board(tmp_path, r, INSIDE, Entry(op, WORLD, 4), {WORLD: 4}, since=0.0))
                for r, op in enumerate(("all_reduce", "broadcast", "all_reduce"))]
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
    with pytest.raises(TypeError, match=r"expects torch.float32 tokens.*got torch.int64: token ids go through an "
                                        r"embedding first"):
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


def test_a_refused_checkpoint_pickle_is_explained_whole(tmp_path):
    from toolkit.parallel import checkpoint

    class Runs:
        def __reduce__(self):
            return (os.system, ("true",))
    path = str(tmp_path / "foreign.pt")
    torch.save({"x": Runs()}, path)
    _, why = checkpoint._read(path)
    assert "holds Python objects other than tensors" in why and "GLOBAL posix.system" in why
    assert "torch.load(path, weights_only=False)" in why and "load_full_checkpoint" in why
    (tmp_path / "cut.pt").write_bytes(open(path, "rb").read()[:40])
    assert "damaged (cut short?" in checkpoint._read(str(tmp_path / "cut.pt"))[1]


# --- each case for real, at world 3 ----------------------------------------------------------------------
def _dies_inside_a_collective(how, folder):
    import torch.distributed as dist

    comm.all_reduce(torch.ones(3))
    if dist.get_rank() == 2:
        time.sleep(1.0)  # the others are waiting in all_reduce #2 by now
        with open(os.path.join(folder, "died"), "w") as f:
            f.write(str(time.time()))
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)
    comm.all_reduce(torch.ones(3))
    time.sleep(60)


@pytest.mark.parametrize("how, story", [("kill", "rank 2 died: killed by SIGKILL (9)"),
                                        ("exit", "rank 2 died with exit code 3")])
def test_a_rank_that_dies_inside_a_collective_is_named_not_its_peers(how, story, tmp_path, no_leftover_ranks):
    with pytest.raises(RankError) as info:
        toolkit.launch(_dies_inside_a_collective, 3, args=(how, str(tmp_path)), timeout_s=60, quiet=True)
    seen = time.time() - float((tmp_path / "died").read_text())
    message = str(info.value)
    assert info.value.rank == 2 and message.startswith(story), message
    for peer in (0, 1):  # a peer is listed as a consequence, or (starved on a loaded machine) still waiting
        listed = f"  - rank {peer}: all_reduce #2 (group [0, 1, 2])" in message
        assert listed or f"  rank {peer}: in all_reduce #2 (group [0, 1, 2])" in message, message
        assert not listed or f"  rank {peer}: failed in all_reduce #2 (group [0, 1, 2])" in message, message
    assert "  rank 2: not in a collective (last entered: all_reduce #1 (group [0, 1, 2])" in message
    assert seen < 5, f"the death surfaced {seen:.1f}s after it happened"  # 0.05-0.15 s here, under load


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


def test_blame_goes_by_when_things_happened_not_when_the_launcher_saw_them(tmp_path, monkeypatch,
                                                                           no_leftover_ranks):
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
    start = time.time()
    with pytest.raises(RankError) as info:
        toolkit.launch(_skips_one, 3, args=(raw,), timeout_s=2, quiet=True)
    message = str(info.value)
    assert info.value.rank == 1
    assert message.startswith("rank 1 did not enter all_reduce #4 (group [0, 1, 2]): ranks 0, 2 waited"), message
    assert "  rank 0: in all_reduce #4 (group [0, 1, 2])" in message and "  rank 2: in all_reduce #4" in message
    assert "  rank 1: not in a collective (last entered: all_reduce #3 (group [0, 1, 2])" in message
    assert ("raw torch.distributed" in message) == raw
    assert time.time() - start < 2 + 40  # ranks start in seconds; the launcher's check fires at timeout_s


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


def _loads_a_cut_shard(folder):
    import torch.distributed as dist
    from functools import partial

    from toolkit.parallel import checkpoint

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model, opt = toolkit.parallel.wrap(model, "fsdp", wrap_policy=torch.nn.Linear,
                                       optimizer=partial(torch.optim.AdamW, lr=1e-3))
    path = checkpoint.save_sharded(model, opt, folder)
    if dist.get_rank() == 1:
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
    checkpoint.load_sharded(model, opt, folder)


def test_a_rank_that_cannot_load_its_checkpoint_is_named_with_its_own_error(tmp_path, no_leftover_ranks):
    with pytest.raises(RankError) as info:
        toolkit.launch(_loads_a_cut_shard, 3, args=(str(tmp_path),), timeout_s=30, quiet=True)
    message = str(info.value)
    assert info.value.rank == 1 and message.startswith("rank 1 raised ValueError: could not read the checkpoint")
    assert "shard-00001-of-00003.pt': the file is damaged" in message
    assert "  - rank 0: rank 1 could not load the checkpoint" in message
    assert "  - rank 2: rank 1 could not load the checkpoint" in message


def _loads_a_swapped_shard(folder):
    import shutil
    from functools import partial

    import torch.distributed as dist

    from toolkit.parallel import checkpoint

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model, opt = toolkit.parallel.wrap(model, "fsdp", wrap_policy=torch.nn.Linear,
                                       optimizer=partial(torch.optim.AdamW, lr=1e-3))
    path = checkpoint.save_sharded(model, opt, folder)
    comm.barrier()
    if dist.get_rank() == 2:  # rank 0's file copied over rank 2's: same shapes, same layout, wrong slices
        shutil.copyfile(path.replace("shard-00002", "shard-00000"), path)
    comm.barrier()
    before = [u.master.clone() for u in model.engine.units]
    try:
        checkpoint.load_sharded(model, opt, folder)
    finally:
        unchanged = all(torch.equal(a, u.master) for a, u in zip(before, model.engine.units))
        open(os.path.join(folder, f"unchanged-{dist.get_rank()}"), "w").write(str(unchanged))


def test_a_shard_file_of_another_rank_is_refused_naming_the_file_and_both_ranks(tmp_path, no_leftover_ranks):
    """Every shard has the same shapes, so a file copied from another rank loads without a shape error: only
    the rank it records can tell. Before this check rank 2 silently held rank 0's slices."""
    with pytest.raises(RankError) as info:
        toolkit.launch(_loads_a_swapped_shard, 3, args=(str(tmp_path),), timeout_s=30, quiet=True)
    message = str(info.value)
    assert info.value.rank == 2, message
    assert message.startswith("rank 2 raised ValueError: ") and "shard-00002-of-00003.pt" in message, message
    assert "was written by rank 0 (slice 0 of its sharding group), not rank 2 (slice 2)" in message, message
    assert "  - rank 0: rank 2 could not load the checkpoint" in message
    assert all((tmp_path / f"unchanged-{r}").read_text() == "True" for r in range(3))


class _GoesNanOnRank1AtStep2(torch.nn.Module):
    """A model whose loss is NaN on rank 1 at step 2 only: afterwards the all-reduced gradients carry it."""

    def __init__(self, config):
        super().__init__()
        self.inner, self.calls = toolkit.train.build_model(config), 0

    def forward(self, x, y):
        import torch.distributed as dist

        loss = self.inner(x, y)
        self.calls += 1
        return loss * float("nan") if dist.get_rank() == 1 and self.calls == 3 else loss


def test_a_nan_loss_names_the_rank_and_step_where_it_first_appeared(no_leftover_ranks):
    """Every rank's loss is NaN from step 3 on; before, the run returned NaN losses and named nobody."""
    from toolkit.train import TrainConfig, launch_train

    config = TrainConfig(strategy="ddp", steps=5, global_batch_size=6, progress=False, sample_memory=False,
                         model=dict(n_layer=1, d_model=16, n_head=2))
    with pytest.raises(RankError) as info:
        launch_train(config, 3, model_fn=_GoesNanOnRank1AtStep2, timeout_s=60, quiet=True)
    message = str(info.value)
    assert info.value.rank == 1, message
    assert message.startswith("rank 1 raised NonFiniteLoss: the loss went non-finite first on rank 1 at step 2 "
                              "(of steps 0-4), and the run ended non-finite; this rank's loss there was nan."), message
    for other in (0, 2):
        assert (f"  - rank {other}: the loss went non-finite first on rank 1 at step 2" in message
                and "went non-finite at step 3 only because the gradient all-reduce spread it here" in message), message


# --- under mpiexec -------------------------------------------------------------------------------------
MPI_SCRIPT = textwrap.dedent("""
    import os, sys, time, torch, toolkit
    place = toolkit.runtime.init()
    open(os.path.join(sys.argv[1], str(os.getpid())), "w").close()
    toolkit.comm.all_reduce(torch.ones(3))
    if place.rank == 1:
        raise ValueError("rank one is unhappy")
    time.sleep(60)  # the others compute on: only an abort ends them early
""")


def test_under_mpiexec_a_raising_rank_ends_the_job_with_its_traceback_once(tmp_path):
    from test_launchers import _bin, _clean_env, gone

    if _bin("mpiexec") is None:
        pytest.skip("no mpiexec on this machine")
    script, pids = tmp_path / "job.py", tmp_path / "pids"
    script.write_text(MPI_SCRIPT)
    pids.mkdir()
    start = time.time()
    out = subprocess.run([_bin("mpiexec"), "-n", "3", sys.executable, str(script), str(pids)], capture_output=True,
                         text=True, timeout=90, env=_clean_env(), cwd=tmp_path)
    elapsed = time.time() - start
    assert out.returncode != 0
    assert elapsed < 45, f"the job ran on for {elapsed:.0f}s after rank 1 raised"  # ~6 s here, under load
    err = out.stderr
    assert err.count("ValueError: rank one is unhappy") == 1, err
    assert "[rank1]: toolkit: rank 1 raised ValueError; ending the whole job (MPI_Abort)" in err
    assert len(os.listdir(pids)) == 3
    assert gone([int(p) for p in os.listdir(pids)]), "a rank outlived its job"


@pytest.mark.parametrize("raised_first", [False, True])
def test_the_witness_names_the_first_silent_death_only(tmp_path, raised_first):
    """Three stand-in ranks on this machine: rank 2 is SIGKILLed, then the launcher kills rank 0. Only rank 2 is
    named, with its signal; and nobody is, when a rank had raised first (the kills are then the job ending)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    ranks = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    witness = os.path.join(os.path.dirname(toolkit.runtime.__file__), "witness.py")
    try:
        seen = subprocess.Popen([sys.executable, witness, str(marks), "host-a"] +
                                [f"{r}:{p.pid}" for r, p in enumerate(ranks)], stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 30
        while not (marks / "watching").exists() and time.time() < deadline:
            time.sleep(0.01)
        if raised_first:
            (marks / "raised-1").touch()
        ranks[2].kill(), ranks[2].wait()
        time.sleep(0.3)
        for p in (ranks[0], ranks[1]):
            p.kill(), p.wait()
        told = seen.communicate(timeout=30)[1]
    finally:
        for p in ranks:
            p.kill(), p.wait()
    assert seen.returncode == 0 and not marks.exists()  # it tidies up after itself
    if raised_first:
        assert told == ""
    else:
        assert told.startswith(f"[rank2]: toolkit: rank 2 (pid {ranks[2].pid} on host-a) died: killed by SIGKILL (9)")
        assert "It is the cause" in told and "rank 0" not in told and "rank 1" not in told, told


DIES_UNDER_MPIEXEC = textwrap.dedent("""
    import os, signal, sys, time, torch, toolkit
    place = toolkit.runtime.init()
    open(os.path.join(sys.argv[1], str(os.getpid())), "w").close()
    toolkit.comm.all_reduce(torch.ones(3))
    if place.rank == 2:
        time.sleep(0.5)  # ranks 0 and 1 are waiting in all_reduce #2 by now
        if sys.argv[2] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if sys.argv[2] == "exit":
            os._exit(3)
        sys.exit(0)  # "return": the script ends, past the collective the others wait in
    toolkit.comm.all_reduce(torch.ones(3))
    time.sleep(60)
""")


@pytest.mark.parametrize("how, story", [
    ("kill", r"rank 2 \(pid \d+( on \S+)?\) died: killed by SIGKILL \(9\)"),
    ("exit", r"rank 2 \(pid \d+( on \S+)?\) died with exit code 3 before returning"),
    ("return", r"rank 2 finished its script \(it returned, or called sys.exit\) while this rank still waited for it "
               r"in a collective: it returned early, past a collective the others entered"),
])
def test_under_mpiexec_a_rank_that_dies_without_raising_is_named_with_how(how, story, tmp_path):
    """0 of 6 before: the survivors said "PeerFailed because another rank failed (its traceback is the one to
    read)", with no such traceback; on a SIGKILL mpiexec killed them before even that, and named a pid only."""
    import re

    from test_launchers import _bin, _clean_env, gone

    if _bin("mpiexec") is None:
        pytest.skip("no mpiexec on this machine")
    script, pids, scratch = tmp_path / "job.py", tmp_path / "pids", tmp_path / "tmp"
    script.write_text(DIES_UNDER_MPIEXEC)
    pids.mkdir(), scratch.mkdir()
    out = subprocess.run([_bin("mpiexec"), "-n", "3", sys.executable, str(script), str(pids), how],
                         capture_output=True, text=True, timeout=150, env=dict(_clean_env(), TMPDIR=str(scratch)),
                         cwd=tmp_path)
    assert out.returncode != 0
    assert re.search(story, out.stderr), out.stderr
    assert "its traceback is the one to read" not in out.stderr, out.stderr
    assert len(os.listdir(pids)) == 3 and gone([int(p) for p in os.listdir(pids)]), "a rank outlived its job"
    deadline = time.time() + 15  # the witness removes its folder once every rank of its machine has ended
    while os.listdir(scratch) and time.time() < deadline:
        time.sleep(0.1)
    assert not os.listdir(scratch), os.listdir(scratch)

