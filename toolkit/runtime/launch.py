"""Start N real ranks from a notebook cell or a script, and get their results back.

How it works, in the order it happens:
1. `fn` and its arguments are pickled *by value* with cloudpickle, so a function defined in a notebook
   cell or in a script's `__main__` travels (plain multiprocessing spawn cannot pickle those, and
   forking a parent that already ran torch can deadlock the children's thread pools).
2. The parent hosts the rendezvous store on a port the OS picks, so launches never collide.
3. Each rank is a fresh `python -m toolkit.runtime.worker` process in its own process group;
   it initializes torch.distributed, runs `fn(*args)` and writes its result (or its traceback) to a
   private temporary folder.
4. The parent watches: the first rank to fail, or a rank stuck in one collective for longer than
   `timeout_s`, stops every rank at once and raises with that rank's number and story. Ctrl-C
   (a notebook's stop button) stops them too. No process outlives the call.
"""
from __future__ import annotations

import datetime
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time

import cloudpickle
import torch.distributed as dist

from . import status
from .env import resolve_backend


class RankError(RuntimeError):
    """A rank raised, died or hung; the message names the rank and says what happened."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


def _forward(stream, rank: int, sink) -> None:
    """Copy a rank's output to ours, each line prefixed with its rank."""
    for line in iter(stream.readline, b""):
        sink.write(f"[rank {rank}] {line.decode(errors='replace')}")
        sink.flush()
    stream.close()


def _kill_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def _read_error(folder: str, rank: int):
    path = os.path.join(folder, f"error-{rank}.pkl")
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except (EOFError, pickle.UnpicklingError):  # still being written
        return None


def _who_is_where(boards) -> str:
    return "\n".join(f"  rank {r}: {b.describe()}" for r, b in enumerate(boards))


def launch(fn, world_size: int, *, args=(), backend: str = "auto", timeout_s: float = 120.0,
           deadline_s: float | None = None, threads_per_rank: int | None = None, quiet: bool = False):
    """Run `fn(*args)` on `world_size` ranks with the default process group ready; return results in rank order.

    timeout_s: how long one rank may wait inside one collective before the job is stopped.
    deadline_s: a limit on the whole call's wall-clock time (None: no limit), for work that may loop
        without ever entering a collective (a grader running a student's code, say).
    threads_per_rank: torch CPU threads each rank uses (default: the cores shared out evenly).
    quiet: drop the ranks' printed output instead of forwarding it with a "[rank r]" prefix.
    """
    if not callable(fn):
        raise TypeError(f"launch needs a function to run on every rank, got {type(fn).__name__}.")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}.")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}.")
    backend = resolve_backend(backend, world_size)
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)

    with tempfile.TemporaryDirectory(prefix="toolkit-launch-") as folder:
        with open(os.path.join(folder, "job.pkl"), "wb") as f:
            pickle.dump({"payload": cloudpickle.dumps((fn, tuple(args))), "sys_path": list(sys.path),
                              "backend": backend, "timeout_s": timeout_s, "threads": threads}, f)
        boards = [status.StatusBoard(status.board_path(folder, r), create=True) for r in range(world_size)]
        store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s + 30))
        env = dict(os.environ, WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                   TOOLKIT_STORE_PORT=str(store.port), TOOLKIT_LAUNCH_DIR=folder,
                   OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
        for var in ("MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
            env.pop(var, None)  # we are the launcher now, whoever launched us
        procs, pumps = [], []
        try:
            for rank in range(world_size):
                env_r = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
                p = subprocess.Popen([sys.executable, "-m", "toolkit.runtime.worker", folder],
                                     env=env_r, start_new_session=True, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                procs.append(p)
                sink = open(os.devnull, "w") if quiet else sys.stdout
                t = threading.Thread(target=_forward, args=(p.stdout, rank, sink), daemon=True)
                t.start()
                pumps.append(t)
            _watch(procs, boards, folder, timeout_s, deadline_s)
            for t in pumps:
                t.join(timeout=5)
            results = []
            for rank in range(world_size):
                with open(os.path.join(folder, f"result-{rank}.pkl"), "rb") as f:
                    results.append(pickle.load(f))
            return results
        finally:
            _kill_all(procs)
            for b in boards:
                b.close()
            del store


def _watch(procs, boards, folder: str, timeout_s: float, deadline_s: float | None) -> None:
    """Wait for every rank; on the first failure or hang, stop them all and raise."""
    started = time.time()
    while True:
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes):
            return
        errors = {r: e for r in range(len(procs)) if (e := _read_error(folder, r)) is not None}
        if errors:
            time.sleep(0.2)  # let near-simultaneous failures land, then blame the earliest
            errors = {r: e for r in range(len(procs)) if (e := _read_error(folder, r)) is not None}
            where = _who_is_where(boards)
            _kill_all(procs)
            rank, err = min(errors.items(), key=lambda item: item[1]["time"])
            raise RankError(f"rank {rank} raised {err['type']}: {err['message']}\n"
                            f"where every rank was:\n{where}\n\n"
                            f"traceback of rank {rank}:\n{err['traceback']}", rank)
        dead = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if dead:
            time.sleep(0.2)
            if any(_read_error(folder, r) is not None for r in range(len(procs))):
                continue  # report the Python error instead of the bare exit code
            where = _who_is_where(boards)
            _kill_all(procs)
            rank = dead[0]
            raise RankError(f"rank {rank} died with exit code {codes[rank]} before returning "
                            f"(killed by a signal or out of memory?).\nwhere every rank was:\n{where}", rank)
        states = [board.read() for board in boards]
        stuck = max(range(len(boards)), key=lambda r: states[r][0])
        if states[stuck][0] > timeout_s + 5:  # the rank's own timeout had its chance first
            where = _who_is_where(boards)
            _kill_all(procs)
            absent = [r for r, (waited, _, _) in enumerate(states) if not waited]
            raise RankError(f"rank {stuck} hung for {states[stuck][0]:.0f}s in {states[stuck][2]} "
                            f"(timeout_s={timeout_s}); all ranks were stopped. Ranks not in any collective: "
                            f"{absent or 'none'}.\nwhere every rank was:\n{where}\n"
                            "A collective completes only when every rank of its group calls it: "
                            "look for a rank that skipped it or called another one.", stuck)
        if deadline_s is not None and time.time() - started > deadline_s:
            where = _who_is_where(boards)
            _kill_all(procs)
            raise RankError(f"the ranks ran past deadline_s={deadline_s}s and were stopped.\n"
                            f"where every rank was:\n{where}")
        time.sleep(0.02)
