"""toolkit.launch: results in rank order, functions from notebooks and __main__, and every failure path."""

import contextlib
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
from toolkit.runtime import RankError

pytestmark = pytest.mark.timeout(120)


def _everything(tag):
    """Runs on every rank: each collective once, returns tensors and facts about the rank."""
    import torch.distributed as dist

    r, n = dist.get_rank(), dist.get_world_size()
    x = torch.arange(5, dtype=torch.float32) + r
    comm.all_reduce(x)
    gathered = torch.empty(n * 2)
    comm.all_gather(gathered, torch.full((2,), float(r)))
    mine = torch.empty(3)
    comm.reduce_scatter(mine, torch.arange(3.0 * n) * (r + 1))
    b = torch.full((4,), float(r))
    comm.broadcast(b, src=n - 1)
    return {
        "tag": tag,
        "rank": r,
        "world": n,
        "pid": os.getpid(),
        "sum": x,
        "gathered": gathered,
        "scattered": mine,
        "broadcast": b,
        "threads": torch.get_num_threads(),
    }


@pytest.mark.parametrize("world_size", [1, 3, 4])  # 2 ranks: test_parallel_launches_never_collide
def test_results_arrive_in_rank_order_with_tensors_intact(world_size, no_leftover_ranks):
    results = toolkit.launch(_everything, world_size, args=("hi",), timeout_s=30)
    n = world_size
    total = n * (n - 1) / 2
    assert [r["rank"] for r in results] == list(range(n))
    assert len({r["pid"] for r in results}) == n and os.getpid() not in {r["pid"] for r in results}
    for r in results:
        assert r["tag"] == "hi" and r["world"] == n
        torch.testing.assert_close(r["sum"], torch.arange(5.0) * n + total)
        torch.testing.assert_close(r["gathered"], torch.arange(n).repeat_interleave(2).float())
        expected = torch.arange(3.0 * n)[3 * r["rank"] : 3 * r["rank"] + 3] * (n * (n + 1) / 2)
        torch.testing.assert_close(r["scattered"], expected)
        torch.testing.assert_close(r["broadcast"], torch.full((4,), float(n - 1)))
        assert r["threads"] == max(1, (os.cpu_count() or 1) // n)


def test_function_defined_in_a_notebook_cell_travels(no_leftover_ranks):
    """A notebook cell's function lives in `__main__` with no file behind it: exec one the same way."""
    namespace = {"__name__": "__main__"}
    exec(
        textwrap.dedent("""
        import torch
        import torch.distributed as dist
        from toolkit import comm
        SCALE = 10
        def cell_function(k):
            x = torch.ones(2) * (dist.get_rank() + 1) * SCALE * k
            comm.all_reduce(x)
            return x
    """),
        namespace,
    )
    torch.ones(64, 64) @ torch.ones(64, 64)  # a parent that already ran torch, as a notebook has
    out = toolkit.launch(namespace["cell_function"], 2, args=(2,), timeout_s=30)
    assert [o.tolist() for o in out] == [[60.0, 60.0]] * 2


def test_a_cells_traceback_shows_its_file_line_and_source(no_leftover_ranks):
    """IPython names a cell's code `<ipython-input-N-...>` and keeps its source in linecache; cloudpickle renamed
    every copied code object `<dynamic-code>`, so the rank's traceback had neither the name nor the source."""
    import linecache

    name = "<ipython-input-7-5f2c>"
    source = textwrap.dedent("""
        import torch.distributed as dist
        def cell_function():
            if dist.get_rank() == 1:
                raise ValueError("from the cell")
    """)
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    namespace = {"__name__": "__main__"}
    exec(compile(source, name, "exec"), namespace)
    with pytest.raises(RankError) as info:
        toolkit.launch(namespace["cell_function"], 2, timeout_s=30, quiet=True)
    message = str(info.value)
    assert f'File "{name}", line 5, in cell_function\n    raise ValueError("from the cell")' in message, message
    assert "<dynamic-code>" not in message


def test_function_from_a_script_main_travels(tmp_path, no_leftover_ranks):
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent("""
        import torch, toolkit
        torch.ones(8) @ torch.ones(8)
        def square_rank():
            import torch.distributed as dist
            return dist.get_rank() ** 2
        print("RESULT", toolkit.launch(square_rank, 3, timeout_s=30))
    """)
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    assert "RESULT [0, 1, 4]" in out.stdout


def test_rank_output_is_forwarded_with_its_rank(capfd, no_leftover_ranks):
    def speak():
        import torch.distributed as dist

        print("hello from", dist.get_rank())

    toolkit.launch(speak, 2, timeout_s=30)
    time.sleep(0.1)
    text = capfd.readouterr().out
    assert "[rank 0] hello from 0" in text and "[rank 1] hello from 1" in text


def _raise_on_rank_1(pid_dir):
    import torch.distributed as dist

    open(os.path.join(pid_dir, str(os.getpid())), "w").close()
    if dist.get_rank() == 1:
        raise ValueError("rank one is unhappy")
    comm.all_reduce(torch.ones(3))  # rank 0 waits here for a partner that never comes
    time.sleep(60)


def _assert_dead(pid_dir):
    pids = [int(p) for p in os.listdir(pid_dir)]
    assert pids, "the ranks never started"
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_raising_rank_stops_everything_promptly(tmp_path, no_leftover_ranks):
    with pytest.raises(RankError) as info:
        # promptly: a launch that waited for rank 0's collective to time out would outlast this test's own limit
        toolkit.launch(_raise_on_rank_1, 3, args=(str(tmp_path),), timeout_s=3600)
    message = str(info.value)
    assert info.value.rank == 1
    assert message.startswith("rank 1 raised ValueError: rank one is unhappy")
    assert "traceback of rank 1" in message and "_raise_on_rank_1" in message  # the rank's own traceback
    assert "  rank 1: not in a collective (none entered yet); raised ValueError" in message
    _assert_dead(tmp_path)
    assert toolkit.launch(lambda: 7, 2, timeout_s=30) == [7, 7]  # the next launch works


def _stuck_inside_a_collective():
    """Simulate a rank stuck in C inside a collective that never times out by itself."""
    import torch.distributed as dist

    from toolkit.runtime import status

    if dist.get_rank() == 0:
        status.enter("all_gather #7 (phase 'forward', group ranks [0, 1], 12 x float32)")
    time.sleep(120)


def test_the_launcher_watchdog_stops_a_rank_stuck_in_a_collective(no_leftover_ranks):
    with pytest.raises(RankError) as info:
        toolkit.launch(_stuck_inside_a_collective, 2, timeout_s=1)
    assert "hung" in str(info.value) and "all_gather #7" in str(info.value)
    assert "Ranks not in any collective: [1]" in str(info.value)


def test_parallel_launches_never_collide(no_leftover_ranks):
    results, errors = {}, []

    def one(key):
        try:
            results[key] = toolkit.launch(_everything, 2, args=(key,), timeout_s=60)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(k,)) for k in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert {r["tag"] for r in results["a"]} == {"a"} and {r["tag"] for r in results["b"]} == {"b"}


_SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]
_ORPHAN_MAKER = [
    sys.executable,
    "-c",
    "import subprocess as s, sys; print(s.Popen(sys.argv[1:], start_new_session=True, "
    "stdout=s.DEVNULL, stderr=s.DEVNULL).pid)",
] + _SLEEPER


def _leaves_processes_behind(folder, then):
    """A child in a new session (beyond its rank's process group), and an orphan in another session (its
    parent exited at once, so it is nobody's child), both meant to sleep for two minutes."""
    import torch.distributed as dist

    child = subprocess.Popen(_SLEEPER, start_new_session=True)
    orphan = int(subprocess.run(_ORPHAN_MAKER, capture_output=True, text=True, timeout=60).stdout)
    with open(os.path.join(folder, f"pids-{dist.get_rank()}"), "w") as f:
        f.write(f"{child.pid} {orphan}")
    comm.barrier()  # every rank has started its processes
    if then == "raises" and dist.get_rank() == 1:
        raise ValueError("rank one fails after starting its helpers")
    if then == "raises":
        time.sleep(60)
    return "done"


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("then", ["returns", "raises"])
def test_nothing_a_rank_started_outlives_the_launch(then, tmp_path, no_leftover_ranks):
    """Killing each rank's process group missed both: the session child and the orphan slept on."""
    try:
        if then == "returns":
            assert toolkit.launch(_leaves_processes_behind, 2, args=(str(tmp_path), then), timeout_s=60) == ["done"] * 2
        else:
            with pytest.raises(RankError, match="rank 1 raised ValueError: rank one fails after starting"):
                toolkit.launch(_leaves_processes_behind, 2, args=(str(tmp_path), then), timeout_s=60)
        pids = [int(p) for name in os.listdir(tmp_path) for p in (tmp_path / name).read_text().split()]
        assert len(pids) == 4
        survivors = [pid for pid in pids if _alive(pid)]
        assert not survivors, f"still running after launch returned: {survivors}"
    finally:
        for name in os.listdir(tmp_path):
            for pid in (tmp_path / name).read_text().split():
                if _alive(int(pid)):
                    os.kill(int(pid), signal.SIGKILL)


@contextlib.contextmanager
def _launcher_of_sleepy_ranks(tmp_path, **popen):
    """A script whose two ranks sleep for two minutes, started once both ranks are up; (process, their pid folder).
    Whatever the test finds, the script, its zygote, keeper and ranks are gone after it (no failure spreads)."""
    from test_launch_interrupts import kill_leftovers

    script, pid_dir = tmp_path / "launcher.py", tmp_path / "pids"
    pid_dir.mkdir()
    # SIGINT as a terminal gives it: a shell without job control (a suite started with `&`) ignores it for its jobs
    script.write_text(
        textwrap.dedent(f"""
        import os, signal, time, toolkit
        signal.signal(signal.SIGINT, signal.default_int_handler)
        def sleepy():
            with open(os.path.join({str(pid_dir)!r}, str(os.getpid())), "w") as f:
                f.write(os.environ["TOOLKIT_LAUNCH_DIR"])
            time.sleep(120)
        try:
            toolkit.launch(sleepy, 2, timeout_s=300)
        except KeyboardInterrupt:
            print("INTERRUPTED")
    """)
    )
    proc = subprocess.Popen([sys.executable, str(script)], **popen)
    try:
        deadline = time.time() + 90
        while len(os.listdir(pid_dir)) < 2 and time.time() < deadline:
            time.sleep(0.1)
        yield proc, pid_dir
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        kill_leftovers()


def test_keyboard_interrupt_stops_all_ranks(tmp_path):
    from test_launch_interrupts import kill_leftovers
    from test_launchers import gone

    with _launcher_of_sleepy_ranks(tmp_path, stdout=subprocess.PIPE, text=True) as (proc, pid_dir):
        pids = [int(p) for p in os.listdir(pid_dir)]
        assert len(pids) == 2, "the ranks never started"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        assert "INTERRUPTED" in out
        assert gone(pids, patience_s=10), "a rank outlived its interrupted launch"
        assert not kill_leftovers(), "the launch's keeper or zygote outlived it"
        assert not os.path.exists((pid_dir / str(pids[0])).read_text()), "the launch's folder was left"


def test_a_killed_launcher_takes_its_ranks_with_it(tmp_path):
    """A notebook kernel restarted (SIGKILL): its keeper learns it from the kernel and kills every rank."""
    from test_launchers import gone

    with _launcher_of_sleepy_ranks(tmp_path) as (proc, pid_dir):
        proc.kill()
        proc.wait()
        pids = [int(p) for p in os.listdir(pid_dir)]
        assert len(pids) == 2 and gone(pids, patience_s=30), "a rank outlived its launcher"
        folder = (pid_dir / str(pids[0])).read_text()
        deadline = time.time() + 15  # the keeper removes the launch's folder, as the launcher would have
        while os.path.exists(folder) and time.time() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(folder), folder


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        toolkit.launch(lambda: 0, 0)
    with pytest.raises(TypeError, match="needs a function"):
        toolkit.launch(42, 2)
    for bad in (0, -1, float("nan"), float("inf"), "10"):  # NaN used to fail later: "cannot convert float NaN"
        with pytest.raises(ValueError, match=r"timeout_s must be a finite number of seconds greater than 0, got"):
            toolkit.launch(lambda: 0, 2, timeout_s=bad)
    with pytest.raises(ValueError, match=r"deadline_s must be a finite number of seconds greater than 0, got nan"):
        toolkit.launch(lambda: 0, 2, deadline_s=float("nan"))
    with pytest.raises(ValueError, match="backend='mpi' is not known"):
        toolkit.launch(lambda: 0, 2, backend="mpi")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs one GPU per local rank"):
            toolkit.launch(lambda: 0, 2, backend="nccl")


def test_a_deadline_stops_ranks_that_never_reach_a_collective(tmp_path, no_leftover_ranks):
    def spin(folder):
        import torch.distributed as dist

        open(os.path.join(folder, str(dist.get_rank())), "w").close()
        while True:
            pass

    with pytest.raises(RankError, match="deadline_s=3") as info:  # the deadline, not the test's limit, ended it
        toolkit.launch(spin, 2, args=(str(tmp_path),), deadline_s=3)
    # A rank that was spinning is shown where it spins (on a starved machine a rank may not have started in
    # 3 s: test_a_rank_stuck_in_compute_is_shown_where_it_is shows stacks whatever the load).
    spinning = [int(name) for name in os.listdir(tmp_path)]
    for rank in spinning:
        assert f"where rank {rank} was when it was stopped" in str(info.value), str(info.value)
    assert str(info.value).count(", in spin\n") == len(spinning), str(info.value)


def test_not_implemented_reaches_the_caller_as_such(no_leftover_ranks):
    def unfinished(tensor, op, group, async_op):
        raise NotImplementedError("write the ring all-reduce")

    def work():
        with comm.using({"all_reduce": unfinished}):
            comm.all_reduce(torch.ones(2))

    with pytest.raises(RankError, match="raised NotImplementedError: write the ring all-reduce"):
        toolkit.launch(work, 2, timeout_s=30)
