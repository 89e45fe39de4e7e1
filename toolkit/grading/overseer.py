"""The grader's watch over one launch: the limits that no process of the launch can patch, because none of them
decides them.

Inside each rank a watchdog stops a check that runs too long and names the line it was on (`watchdog.py`). It
lives in the submission's process, so a submission can switch it off (patch its class, kill its thread). The
overseer runs in the grader, reads only what the kernel and the filesystem say, and stops the launch from
outside (`session._stop`) when:

- **time**: no rank makes progress for longer than the time limit (plus `GRACE_S` for what runs between two
  checks): progress is a rank's result file for the phase that is running (the import first, then each check in
  order), seen appearing; before every rank has said it is ready (no submission code has run yet) the launch has
  `STARTUP_S`. A rank that fakes progress by writing results ahead gains nothing: the whole launch has at
  most one time limit per phase;
- **output**: the ranks print more than the output limit. What they print comes to the grader through a pipe
  that it alone reads: it keeps the first `output_limit_mb` of it in the launch's log, echoes it (made harmless,
  `untrusted.clean`) when asked, and stops the launch past it;
- **processes**: the grading holds more processes than `max_processes` (found by the grading's id, and where the
  launch has a PID namespace, every process in it: `isolation`), root or not (RLIMIT_NPROC does not limit root,
  and counts a user's processes on the whole machine, not a grading's).

Its verdict has the watchdog's form ({"index", "message", "stop"}): the check that was running scores 0 with the
message, and a stop at the import stops the grading (index None: the ranks never got ready).
"""

from __future__ import annotations

import codecs
import os
import select
import time

from . import isolation, untrusted
from .runner import IMPORT, ready_path, result_path

GRACE_S = 10.0  # beyond the time limit: a check's group, the wait for its peers, the result written
STARTUP_S = 120.0  # until every rank is ready, before any submission code runs (ranks forked, torch set up)
POLL_S = 0.1


class Overseer:
    """Watch one launch until its launcher ends or a limit is passed; `run()` returns the verdict, or None."""

    def __init__(
        self,
        process,
        output_fd: int,
        log,
        folder: str,
        world_size: int,
        order: list,
        limits,
        grading_id: str,
        spare=(),
        echo=None,
    ):
        self.process, self.output_fd, self.log, self.folder = process, output_fd, log, folder
        self.world_size, self.order, self.limits = world_size, order, limits
        self.grading_id, self.spare, self.echo = grading_id, set(spare), echo
        self.printed, self.seen, self.ready, self.namespace = 0, 0, False, None
        self.cap = int(limits.output_limit_mb * 2**20)
        self.deadline_s = len(order) * (limits.time_limit_s + GRACE_S) + STARTUP_S
        self._decode = codecs.getincrementaldecoder("utf-8")(errors="replace")
        os.set_blocking(output_fd, False)

    def run(self) -> dict | None:
        started = last_progress = time.monotonic()
        counted = 0.0
        while True:
            select.select([self.output_fd], [], [], POLL_S)
            if self._take() == "flooded":
                return self._verdict(
                    f"the ranks printed more than {self.limits.output_limit_mb:g} MiB (the grader's "
                    "limit on output): the launch was stopped"
                )
            if self.process.poll() is not None:
                self._take()
                return None
            now = time.monotonic()
            seen = self._progress()
            if seen > self.seen:
                self.seen, last_progress = seen, now
            allowed = self.limits.time_limit_s + GRACE_S if self.ready else STARTUP_S
            if now - last_progress > allowed or now - started > self.deadline_s:
                if not self.ready:  # no submission code ran yet: the machine's trouble, not the submission's
                    return {"index": None, "message": f"the ranks were not ready after {STARTUP_S:g} s", "stop": True}
                return self._over_time()
            if now - counted > 0.5:
                counted = now
                if self.namespace is None:  # the launch's own PID namespace, once its first process is there
                    self.namespace = isolation.namespace_below(self.process.pid)
                held = set(isolation.marked(self.grading_id))  # those that kept the grading's id, and (where the
                held |= set(isolation.in_namespace(self.namespace)) if self.namespace else set()  # launch has one)
                held = len(held - self.spare)  # every process in its PID namespace, whatever its environment
                if held > self.limits.max_processes:
                    return self._verdict(
                        f"the submission started more than {self.limits.max_processes} processes "
                        "(the grader's process limit): they were all stopped",
                        stop=True,
                    )

    def _take(self) -> str:
        """Read what the ranks printed so far: into the log up to the cap, and to the echo."""
        while True:
            try:
                chunk = os.read(self.output_fd, 1 << 16)
            except BlockingIOError:
                return ""
            except OSError:
                return ""
            if not chunk:
                return ""
            room = self.cap - self.printed
            self.printed += len(chunk)
            if room > 0:
                self.log.write(chunk[:room])
                self.log.flush()
                if self.echo is not None:
                    self.echo.write(untrusted.clean(self._decode.decode(chunk[:room])))
                    self.echo.flush()
            if self.printed > self.cap:
                return "flooded"

    def _progress(self) -> int:
        """How many of the launch's milestones exist: every rank ready, then every rank's result of each phase."""
        found = 0
        if not self.ready:
            self.ready = all(untrusted.is_file(ready_path(self.folder, r)) for r in range(self.world_size))
            if not self.ready:
                return 0
        for index in self.order:
            done = sum(untrusted.is_file(result_path(self.folder, index, r)) for r in range(self.world_size))
            found += done
            if done < self.world_size:
                break
        return found + 1

    def running(self):
        """The phase the launch is in: the first (the import, then each check) not every rank has finished."""
        for index in self.order:
            if not all(untrusted.is_file(result_path(self.folder, index, r)) for r in range(self.world_size)):
                return index
        return self.order[-1]

    def _verdict(self, message: str, stop: bool | None = None) -> dict:
        index = self.running()
        return {"index": index, "message": message, "stop": index == IMPORT if stop is None else stop}

    def _over_time(self) -> dict:
        index = self.running()
        late = [r for r in range(self.world_size) if not untrusted.is_file(result_path(self.folder, index, r))]
        who = f"rank{'s' * (len(late) > 1)} {', '.join(map(str, late))}"
        what = "importing your file" if index == IMPORT else "running this check"
        return self._verdict(
            f"{who} still {what} after more than {self.limits.time_limit_s:g} s (the time limit; "
            "stopped by the grader): an endless loop, far too much work, or a wait that never ends."
        )
