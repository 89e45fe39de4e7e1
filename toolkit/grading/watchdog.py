"""Inside each graded rank: a watchdog that notices a stuck check, and a ceiling on memory.

A student's code can stop making progress in three ways, and each must cost seconds, not minutes:

- **deadlock**: every rank waits for a message no rank will send (the classic: a blocking `dist.send`
  before `dist.recv` on every rank of a ring). No timeout is needed to know it: once every rank of the
  check is either blocked or already finished, nothing can ever move again.
- **one-sided wait**: a rank waits for a peer that has finished the check. Same rule.
- **a loop that never ends**, with or without messages: the check's time limit.

How "blocked" is decided, from a thread beside the rank's main thread, four times a second: the main
thread is asleep in the kernel (`/proc/self/task/<tid>/stat` says S: a wait, not a computation), its
innermost Python frame is the same frame object at the same instruction as before, and no
`torch.distributed` call began since the last look. After `stall_s` of that, the rank posts where it is
(the line of the student's file) to the shared folder; the first watchdog to see every rank blocked or
finished writes the story (`deadlock_story.py`) to `deadlock.json`, and every rank then records it as its result
and exits.

The memory ceiling is `sandbox.limit`'s (RLIMIT_DATA, which since Linux 4.7 counts every private writable
mapping: the heap and torch's tensors; not RLIMIT_AS: gloo reserves ~150 MiB of address space per process
group, most of it never touched). An allocation beyond it fails inside the student's code (torch raises
"can't allocate memory"); `out_of_memory` recognises it, so the check fails with a message saying so.

The watchdog runs from before the student's file is imported (index "import"): a loop or a deadlock at
module level is stopped like one inside a check.
"""

from __future__ import annotations

import json
import linecache
import os
import sys
import threading
import time

import torch.distributed as dist

from .deadlock_story import at_line, describe_deadlock

POLL_S = 0.25
COMM_FILES = (os.sep + os.path.join("torch", "distributed") + os.sep, os.sep + os.path.join("toolkit", "comm") + os.sep)
# isend/irecv stay unwrapped: dist.P2POp accepts only the real ones.
_WATCHED = (
    "send",
    "recv",
    "batch_isend_irecv",
    "all_reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_gather",
    "all_gather_into_tensor",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "barrier",
    "gather",
    "scatter",
    "reduce",
)


# --- memory ------------------------------------------------------------------------------------------
def out_of_memory(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, MemoryError) or "can't allocate memory" in text or "std::bad_alloc" in text


# --- progress ----------------------------------------------------------------------------------------
class _Progress:
    """Counts calls into torch.distributed (the module's functions, as `dist.x(...)` calls them)."""

    def __init__(self):
        self.calls = 0
        self.current = ""  # the distributed call the main thread is inside, if any

    def install(self) -> None:
        for name in _WATCHED:
            real = getattr(dist, name, None)
            if real is None or getattr(real, "_counted", False):
                continue
            setattr(dist, name, self._counting(name, real))

    def _counting(self, name, real):
        def call(*args, **kwargs):
            self.calls += 1
            self.current = f"dist.{name}"
            try:
                return real(*args, **kwargs)
            finally:
                self.calls += 1
                self.current = ""

        call._counted, call.__wrapped__ = True, real
        return call


def _thread_state(native_id: int) -> str:
    try:
        with open(f"/proc/self/task/{native_id}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "?"


def _where(frame, solution: str) -> dict:
    """The student's innermost line in this stack, and the distributed call below it (if any)."""
    line, text, call = None, "", ""
    f = frame
    while f is not None:
        name = f.f_code.co_filename
        if not call and any(part in name for part in COMM_FILES):
            call = f.f_code.co_name
        if line is None and os.path.abspath(name) == solution:
            line = f.f_lineno
            text = linecache.getline(name, line).strip()
        f = f.f_back
    return {"line": line, "text": text, "call": call}


# --- the watchdog --------------------------------------------------------------------------------------
class Watchdog:
    """One per rank. `begin(index)` when a check starts, `end()` when its result is written.

    folder: the launch's shared folder; result_path(index, rank): where a rank's result lands.
    """

    def __init__(
        self, folder: str, rank: int, world_size: int, solution: str, result_path, stall_s: float, time_limit_s: float
    ):
        self.folder, self.rank, self.world_size, self.solution = folder, rank, world_size, solution
        self.result_path, self.stall_s, self.time_limit_s = result_path, stall_s, time_limit_s
        self.progress = _Progress()
        self.progress.install()
        self.index, self.started = None, 0.0
        self._last, self._since = None, None  # the last sample: (frame, instruction, calls); asleep since
        self.main = threading.main_thread()
        self._lock = threading.Lock()
        threading.Thread(target=self._run, daemon=True, name="grading-watchdog").start()

    def begin(self, index: int) -> None:
        with self._lock:
            self.index, self.started, self._last, self._since = index, time.monotonic(), None, None

    def end(self) -> None:
        """The check is over: forget its frames at once (a kept frame keeps the student's locals alive)."""
        with self._lock:
            self.index, self._last, self._since = None, None, None
        _remove(self._stuck_path(self.rank))

    def _stuck_path(self, rank: int) -> str:
        return os.path.join(self.folder, f"stuck-{rank}.json")

    def _run(self) -> None:
        while True:
            time.sleep(POLL_S)
            verdict = _read(os.path.join(self.folder, "deadlock.json"))
            if verdict is not None:
                self._give_up(verdict)
            frame = sys._current_frames().get(self.main.ident)
            asleep = _thread_state(self.main.native_id) == "S"
            with self._lock:
                index, started, stuck_for = self.index, self.started, self._observe(frame, asleep)
            if index is not None and stuck_for >= self.stall_s:
                where = _where(frame, self.solution)
                where.update(
                    index=index,
                    rank=self.rank,
                    since=time.time() - stuck_for,
                    call=self.progress.current or where["call"],
                )
                _write(self._stuck_path(self.rank), where)
                self._check_everyone(index)
            del frame
            if index is not None and time.monotonic() - started > self.time_limit_s:
                self._over_time(index)

    def _observe(self, frame, asleep: bool) -> float:
        """Seconds the main thread has been asleep at the same frame and instruction, with no distributed
        call in between (0.0 while it moves). Called with the lock held, so `end()` wins any race."""
        if self.index is None or frame is None:
            return 0.0
        state = (frame, frame.f_lasti, self.progress.calls)
        last = self._last
        self._last = state
        moved = last is None or last[0] is not frame or last[1:] != state[1:]
        if moved or not asleep:
            if self._since is not None:
                _remove(self._stuck_path(self.rank))
            self._since = time.monotonic() if asleep else None
            return 0.0
        if self._since is None:  # it was running at this very instruction, and now waits there
            self._since = time.monotonic()
        return time.monotonic() - self._since

    def _check_everyone(self, index: int) -> None:
        """Every rank blocked in this check, or finished with it: nothing can move again."""
        stuck, done = {}, []
        for r in range(self.world_size):
            if os.path.exists(self.result_path(index, r)):
                done.append(r)
                continue
            where = _read(self._stuck_path(r))
            if where is None or where.get("index") != index:
                return
            stuck[r] = where
        if stuck:  # a deadlock stops the grading (the next check would deadlock the same way); a one-sided
            # wait stops this launch only
            _claim(
                os.path.join(self.folder, "deadlock.json"),
                {
                    "index": index,
                    "stop": not done,
                    "message": describe_deadlock(stuck, done, self.solution, self.stall_s),
                },
            )

    def _over_time(self, index: int) -> None:
        frame = sys._current_frames().get(self.main.ident)
        where = _where(frame, self.solution) if frame is not None else {"line": None, "text": "", "call": ""}
        del frame
        at = at_line(where, self.solution)
        what = "importing your file" if index == "import" else "this check"
        _claim(
            os.path.join(self.folder, "deadlock.json"),
            {
                "index": index,
                "stop": index == "import",
                "message": (
                    f"rank {self.rank} was still {what if index == 'import' else 'running ' + what} after "
                    f"{self.time_limit_s:.0f} s (last seen{at or ' outside your file'}): an endless loop, or far too "
                    "much work; it was stopped."
                ),
            },
        )

    def _give_up(self, verdict: dict) -> None:
        """Another watchdog (or this one) saw that this check cannot finish: record it and leave."""
        index = verdict["index"]
        if not os.path.exists(self.result_path(index, self.rank)):
            _write(self.result_path(index, self.rank), {"error": verdict["message"], "time": time.time()})
        sys.stdout.flush()
        os._exit(17)


# --- small file helpers (results cross between processes as files) -----------------------------------
def _write(path: str, value) -> None:
    with open(path + f".tmp{os.getpid()}", "w") as f:
        json.dump(value, f)
    os.replace(path + f".tmp{os.getpid()}", path)


def _claim(path: str, value) -> None:
    """Write `value` to `path` unless someone already did (the first verdict wins)."""
    try:
        fd = os.open(path + ".claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.close(fd)
    _write(path, value)


def _read(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
