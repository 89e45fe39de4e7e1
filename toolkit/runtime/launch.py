"""Start N real ranks from a notebook cell or a script, and get their results back.

How it works, in the order it happens:
1. `fn` and its arguments are pickled *by value* with cloudpickle, so a function defined in a notebook
   cell or in a script's `__main__` travels (plain multiprocessing spawn cannot pickle those, and
   forking a parent that already ran torch can deadlock the children's thread pools).
2. The parent hosts the rendezvous store on a port the OS picks, so launches never collide.
3. A small keeper process (`keeper.py`) starts each rank as `python -m toolkit.runtime.worker` would
   start, in its own session, and dates each rank's end as it happens. Keeper and ranks are forked by
   this process's zygote, which imported torch once (`zygote.py`; each rank is made what a fresh
   interpreter would be), or started as fresh interpreters where no zygote can serve (`zygotes.py`). The
   rank initializes torch.distributed, runs `fn(*args)` and writes its result (or its traceback) to a
   private temporary folder.
4. The parent watches every rank's exit code, error file and status board (`status.py`). When one
   fails, it stops every rank at once and raises, naming the rank that *caused* it (`blame.py`): the
   one that raised on its own, died, or never entered a collective its peers waited in for `timeout_s`;
   the others' errors (a lost connection, a timeout) are listed below as consequences. Causes are
   ordered by when they happened (a raise by its rank's clock, a death by the keeper's), not by when
   the launcher saw them. Ctrl-C (a notebook's stop button) stops them too, wherever it lands (`interrupts.py`).
5. No process outlives the call: the keeper is the ranks' subreaper, so whatever they started (an
   orphan, a child in a new session) is still below it at the end, and it kills all of it.
"""

from __future__ import annotations

import datetime
import math
import os
import pickle
import sys
import tempfile
import threading
import time

import torch.distributed as dist

from . import blame, by_value, interrupts, stacks, status
from .env import resolve_backend
from .keeper_handle import Keeper

# The backend's own timeout fires this long after the launcher's hang check, so the check (which can
# still see who never entered the collective) speaks first; the backend's timeout is the backstop.
BACKEND_GRACE_S = 5.0
_SETTLE_S = 2.0  # after a first failure, wait this long at most for the ranks it takes down
_CAUSE_GRACE_S = 2.0  # how long to wait for a cause when only its consequences are visible


class RankError(RuntimeError):
    """A rank raised, died or hung; the message names the rank and says what happened."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


def check_seconds(name: str, value) -> None:
    """A time limit must be a finite positive number of seconds (NaN compares false with everything, so
    `nan <= 0` would let it through to fail later, deep inside torch, as "cannot convert float NaN")."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number of seconds greater than 0, got {value!r}.")


def _forward(stream, rank: int, sink) -> None:
    """Copy a rank's output to ours, each line prefixed with its rank."""
    for line in iter(stream.readline, b""):
        sink.write(f"[rank {rank}] {line.decode(errors='replace')}")
        sink.flush()
    stream.close()


def _read_error(folder: str, rank: int):
    path = os.path.join(folder, f"error-{rank}.pkl")
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except (EOFError, pickle.UnpicklingError):  # still being written
        return None


def launch(
    fn,
    world_size: int,
    *,
    args=(),
    backend: str = "auto",
    timeout_s: float = 120.0,
    deadline_s: float | None = None,
    threads_per_rank: int | None = None,
    quiet: bool = False,
):
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
    check_seconds("timeout_s", timeout_s)
    if deadline_s is not None:
        check_seconds("deadline_s", deadline_s)
    backend = resolve_backend(backend, world_size)
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)

    payload, sources = by_value.dumps(fn, tuple(args))
    # A Ctrl-C (a notebook's stop button) acts at once while the ranks run (`taken` below); anywhere else it waits
    # until every rank is stopped and the folder removed (`interrupts.py`), so none lands between starting the
    # keeper and owning it, or while it is being stopped. Then it reaches the caller as KeyboardInterrupt.
    with interrupts.held(), tempfile.TemporaryDirectory(prefix="toolkit-launch-") as folder:
        keeper, boards, store, pumps = Keeper(folder, world_size), [], None, []
        try:
            with open(os.path.join(folder, "job.pkl"), "wb") as f:
                pickle.dump(
                    {
                        "payload": payload,
                        "sources": sources,
                        "sys_path": list(sys.path),
                        "backend": backend,
                        "timeout_s": timeout_s + BACKEND_GRACE_S,
                        "threads": threads,
                    },
                    f,
                )
            boards = [status.StatusBoard(status.board_path(folder, r), create=True) for r in range(world_size)]
            store = dist.TCPStore(
                "127.0.0.1",
                0,
                None,
                True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=timeout_s + 30),
            )
            keeper.start(_rank_env(folder, world_size, store.port, threads))
            for rank, stream in enumerate(keeper.streams):
                sink = open(os.devnull, "w") if quiet else sys.stdout
                t = threading.Thread(target=_forward, args=(stream, rank, sink), daemon=True)
                t.start()
                pumps.append(t)
            with interrupts.taken():
                _watch(keeper, boards, folder, timeout_s, deadline_s)
            results = []
            for rank in range(world_size):
                with open(os.path.join(folder, f"result-{rank}.pkl"), "rb") as f:
                    results.append(pickle.load(f))
            return results
        finally:
            keeper.stop()  # every rank and whatever it started, in a new session or orphaned
            last_lines = time.monotonic() + 5
            for t in pumps:
                t.join(timeout=max(0.0, last_lines - time.monotonic()))  # the ranks' last lines
            for b in boards:
                b.close()
            del store


def _rank_env(folder: str, world_size: int, port: int, threads: int) -> dict:
    """The launcher's environment as the ranks get it: this launch's settings, no other launcher's."""
    env = dict(
        os.environ,
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        TOOLKIT_STORE_PORT=str(port),
        TOOLKIT_LAUNCH_DIR=folder,
        OMP_NUM_THREADS=str(threads),
        PYTHONUNBUFFERED="1",
    )
    for var in (
        "RANK",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
        "SLURM_PROCID",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_ERROR_FILE",
    ):
        env.pop(var, None)  # we are the launcher now, whoever launched us
    return env


def _evidence(keeper: Keeper, boards, folder: str) -> list[blame.Evidence]:
    """What is known of every rank now; an end is dated by the keeper, when it happened."""
    ended, found = keeper.exits(), []
    for rank in range(keeper.world_size):
        code, ended_at = ended.get(rank, (None, None))
        found.append(
            blame.Evidence(
                rank,
                boards[rank].read(),
                _read_error(folder, rank),
                code,
                ended_at,
                os.path.exists(os.path.join(folder, f"result-{rank}.pkl")),
            )
        )
    return found


def _went_wrong(e: blame.Evidence) -> bool:
    """This rank raised, ended without its result, or saw a collective fail (a peer's death shows there
    first: its sockets close a moment before the launcher can see that it exited)."""
    return (
        e.error is not None
        or e.code not in (None, 0)
        or (e.code == 0 and not e.returned)
        or e.board.state == status.FAILED
    )


def _stacks(keeper: Keeper, folder: str, evidence, ranks) -> str:
    """The Python stacks of those of `ranks` still running (they said nothing themselves), for the message."""
    pids = dict(enumerate(keeper.pids()))
    running = {r: pids[r] for r in ranks if r in pids and evidence[r].code is None and evidence[r].error is None}
    found = stacks.ask(folder, running) if running else {}
    return "".join(
        f"\n\nwhere rank {r} was when it was stopped (its Python stack, most recent call last):\n{text}"
        for r, text in sorted(found.items())
    )


def _orphaned(keeper: Keeper) -> None:
    parent = keeper.orphaned()
    if parent is not None:
        raise RankError(
            f"the zygote that forked this launch's keeper (pid {parent}) ended, killed from outside?, and "
            "the keeper stopped every rank (no rank failed). The next launch starts a new zygote."
        )


def _watch(keeper: Keeper, boards, folder: str, timeout_s: float, deadline_s: float | None) -> None:
    """Wait for every rank; on the first failure or hang, stop them all and raise, naming the cause."""
    started, trouble_since = time.time(), None
    while True:
        evidence = _evidence(keeper, boards, folder)
        if all(e.code == 0 and e.returned for e in evidence):
            return
        if trouble_since is None and any(map(_went_wrong, evidence)):
            trouble_since = time.time()
            while time.time() - trouble_since < _SETTLE_S and any(e.code is None for e in evidence):
                time.sleep(0.02)  # let what it causes land: peers in a collective with it fail at once
                evidence = _evidence(keeper, boards, folder)
        verdict = blame.judge(evidence, time.time(), timeout_s)
        if verdict is not None and (verdict.found_cause or time.time() - trouble_since > _CAUSE_GRACE_S):
            _orphaned(keeper)  # the ranks' deaths are then the keeper's doing, not their own
            named = [verdict.rank] if verdict.rank is not None and not verdict.traceback else []
            raise RankError(verdict.message() + _stacks(keeper, folder, evidence, named), verdict.rank)
        if deadline_s is not None and time.time() - started > deadline_s:
            where = "\n".join(blame.where_every_rank_was(evidence, time.time()))
            raise RankError(
                f"the ranks ran past deadline_s={deadline_s}s and were stopped.\n{where}"
                + _stacks(keeper, folder, evidence, range(len(evidence)))
            )
        _orphaned(keeper)
        if keeper.lost() is not None:
            raise RankError(
                f"the launch's keeper process (which starts and watches the ranks) ended with code "
                f"{keeper.lost()}: killed from outside? Every rank was stopped."
            )
        time.sleep(0.02)
