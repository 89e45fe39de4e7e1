"""The zygote (toolkit/runtime/zygote.py): ranks forked from a process that imported torch once start as a fresh
interpreter would, a dead zygote is replaced and said, and nothing outlives the launcher; fresh interpreters
(TOOLKIT_LAUNCH_EXEC=1, the fallback) still work."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import toolkit
from toolkit.runtime import RankError, zygotes

pytestmark = pytest.mark.timeout(240)


def _facts():
    """What a rank can see of how it was started."""
    import random

    import torch

    def stream(s):
        return s.encoding, s.errors, s.line_buffering, s.write_through, s.isatty(), s.seekable(), s.mode

    folder = os.environ["TOOLKIT_LAUNCH_DIR"]
    fds = sorted(
        (fd, os.readlink(f"/proc/self/fd/{fd}").split(":")[0].replace(folder, "<folder>"))
        for fd in os.listdir("/proc/self/fd")
        if os.path.exists(f"/proc/self/fd/{fd}")
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TOOLKIT_LAUNCH_DIR", "TOOLKIT_STORE_PORT", "TOOLKIT_LAUNCH_EXEC")
    }
    return {
        "env": env,
        "cwd": os.getcwd(),
        "path": sys.path,
        "argv": [a.replace(folder, "<folder>") for a in sys.argv],
        "orig_argv": [a.replace(folder, "<folder>") for a in sys.orig_argv],
        "fds": fds,
        "signals": {int(n): repr(signal.getsignal(n)) for n in signal.valid_signals()},
        "blocked": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "stdio": [stream(sys.stdin), stream(sys.stdout), stream(sys.stderr)],
        "own_session": os.getsid(0) == os.getpid() == os.getpgid(0),
        "parent": os.getppid(),
        "threads": (torch.get_num_threads(), torch.__config__.parallel_info()),
        "umask": [line for line in open("/proc/self/status") if line.startswith("Umask")],
        "main": sys.modules["__main__"].__spec__.name,
        "random": random.random(),
        "main_thread": (
            threading.main_thread().native_id == threading.get_native_id(),
            threading.main_thread() is threading.current_thread(),
        ),
    }


def _ranks_differ_where_they_must(facts):
    """Per-process values: each rank its own random state and the keeper as their one parent; then drop them."""
    assert len({f.pop("random") for f in facts}) == len(facts)
    assert len({f.pop("parent") for f in facts}) == 1
    return facts


def test_a_forked_rank_sees_the_launchers_environment_and_directory_as_a_fresh_interpreter_does(
    tmp_path, monkeypatch, no_leftover_ranks
):
    toolkit.launch(int, 1)  # the zygote starts here, in the test's first directory and environment
    started = zygotes.pids()
    assert len(started) >= 1
    monkeypatch.chdir(tmp_path)  # after the zygote started: its directory and pytest's variable are stale
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "changed after the zygote started")
    forked = _ranks_differ_where_they_must(toolkit.launch(_facts, 2))
    assert zygotes.pids() == started, "a new directory or pytest's variable started another zygote"
    assert forked[0]["env"]["PYTEST_CURRENT_TEST"] == "changed after the zygote started"
    assert forked[0]["cwd"] == str(tmp_path) and forked[0]["path"].index(str(tmp_path)) >= 0

    monkeypatch.setenv("TOOLKIT_LAUNCH_EXEC", "1")  # the same launch as fresh interpreters
    fresh = _ranks_differ_where_they_must(toolkit.launch(_facts, 2))
    for rank in range(2):
        differ = {k: (fresh[rank][k], forked[rank][k]) for k in fresh[rank] if fresh[rank][k] != forked[rank][k]}
        assert not differ, f"rank {rank}: fresh interpreter, forked rank: {differ}"

    monkeypatch.delenv("TOOLKIT_LAUNCH_EXEC")
    monkeypatch.setenv("TOOLKIT_TEST_LATE", "set after the zygote started")  # another zygote, started with it
    assert toolkit.launch(_variable, 1, args=("TOOLKIT_TEST_LATE",)) == ["set after the zygote started"]


def test_a_forked_rank_starts_with_the_launchers_signals_not_the_zygotes_as_under_nohup(monkeypatch, no_leftover_ranks):
    """`nohup` ignores SIGHUP in the launcher, and exec keeps a signal ignored (and the blocked mask): a fresh
    rank of a nohup'd run survives its terminal closing. A forked rank must too, even where the zygote was
    started before (or by another launcher than) the one that asks."""
    toolkit.launch(int, 1)  # the zygote starts with SIGHUP at its default and nothing blocked
    hup, usr2 = int(signal.SIGHUP), int(signal.SIGUSR2)
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # what nohup does before it execs
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])
    try:
        forked = _ranks_differ_where_they_must(toolkit.launch(_facts, 2))
        monkeypatch.setenv("TOOLKIT_LAUNCH_EXEC", "1")
        fresh = _ranks_differ_where_they_must(toolkit.launch(_facts, 2))
    finally:
        signal.signal(signal.SIGHUP, before)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGUSR2])
    for rank in range(2):
        assert fresh[rank]["signals"][hup] == forked[rank]["signals"][hup] == repr(signal.SIG_IGN)
        assert usr2 in fresh[rank]["blocked"] and usr2 in forked[rank]["blocked"]
        assert (fresh[rank]["signals"], fresh[rank]["blocked"]) == (forked[rank]["signals"], forked[rank]["blocked"])
    monkeypatch.delenv("TOOLKIT_LAUNCH_EXEC")
    again = toolkit.launch(_facts, 1)[0]  # and the launcher's later launches get its dispositions as they are
    assert again["signals"][hup] == repr(signal.SIG_IGN if before == signal.SIG_IGN else signal.SIG_DFL)
    assert usr2 not in again["blocked"]


def _variable(name):
    return os.environ.get(name)


def _kills_its_zygote():
    """Rank 0 kills the zygote that forked its keeper (its parent's parent); both ranks then wait."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        with open(f"/proc/{os.getppid()}/stat") as f:
            zygote = int(f.read().rsplit(")", 1)[1].split()[1])
        os.kill(zygote, signal.SIGKILL)
    time.sleep(60)


def test_a_zygote_killed_during_a_launch_is_named_not_a_rank_and_the_next_launch_replaces_it(capfd, no_leftover_ranks):
    toolkit.launch(int, 1)
    with pytest.raises(RankError, match=r"the zygote that forked this launch's keeper \(pid \d+\) ended") as info:
        toolkit.launch(_kills_its_zygote, 2, timeout_s=60)
    assert info.value.rank is None, "a rank was blamed for its keeper's stop"
    assert toolkit.launch(os.getpid, 2)
    assert "had ended (killed by SIGKILL): starting a new one" in capfd.readouterr().err


_LAUNCHER = textwrap.dedent("""
    import os, signal, sys, time, toolkit
    from toolkit.runtime import zygotes

    def path():
        return sys.path
    toolkit.launch(path, 1)
    os.chdir(sys.argv[1])  # a relative PYTHONPATH entry now means another folder
    forked = toolkit.launch(path, 1)
    os.environ["TOOLKIT_LAUNCH_EXEC"] = "1"
    fresh = toolkit.launch(path, 1)
    del os.environ["TOOLKIT_LAUNCH_EXEC"]
    print("PATHS", forked == fresh, os.path.join(sys.argv[1], "rel") in forked[0], flush=True)
    os.kill(zygotes.pids()[0], signal.SIGKILL)
    time.sleep(0.5)
    toolkit.launch(path, 2)  # says so, and starts a new zygote
    print("ZYGOTE", zygotes.pids()[0], flush=True)
    time.sleep(120)  # killed here, its zygote idle
""")


def test_a_relative_pythonpath_a_killed_zygote_and_a_killed_launcher(tmp_path):
    """sys.path as a fresh interpreter computes it from the directory of the launch; a zygote killed while idle
    is said and replaced; the launcher killed (a kernel restarted) while its zygote idles leaves nothing."""
    from test_launchers import gone

    script, there = tmp_path / "launcher.py", tmp_path / "there"
    script.write_text(_LAUNCHER)
    there.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(script), str(there)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH="rel"),
        cwd=tmp_path,
    )
    lines = [proc.stdout.readline() for _ in range(2)]
    assert lines[0] == "PATHS True True\n", (lines, proc.stderr.read() if proc.poll() is not None else "")
    zygote = int(lines[1].split()[1])
    proc.kill()
    _, err = proc.communicate(timeout=60)
    assert "the zygote that forks ranks (pid" in err and "had ended (killed by SIGKILL): starting a new one" in err, err
    assert gone([zygote], patience_s=30), "the zygote outlived its launcher"


def test_fresh_interpreters_still_start_on_request_and_name_a_dead_rank(monkeypatch, no_leftover_ranks):
    monkeypatch.setenv("TOOLKIT_LAUNCH_EXEC", "1")
    with pytest.raises(RankError, match="rank 1 died with exit code 3") as info:
        toolkit.launch(_rank_1_exits, 2, timeout_s=60)
    assert info.value.rank == 1


def _rank_1_exits():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(3)
    toolkit.comm.barrier()


def test_where_the_zygote_cannot_serve_the_reason_is_said_once(monkeypatch, capfd, no_leftover_ranks):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert toolkit.launch(os.getpid, 1) and toolkit.launch(os.getpid, 1)
    err = capfd.readouterr().err
    assert (
        err.count(
            "toolkit.launch: ranks start as fresh interpreters here (the zygote that forks them needs "
            "Linux, not darwin)"
        )
        == 1
    ), err
