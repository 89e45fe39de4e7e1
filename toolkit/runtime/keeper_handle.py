"""The launcher's handle on a keeper (`keeper.py`, the process between `launch` and its ranks): start it, read
what it dated (each rank's exit, their pids, whether it was orphaned), stop it and everything below it.

`Keeper(folder, world_size)`, `keeper.start(env)`, `keeper.exits()`, `keeper.pids()`, `keeper.stop()`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from . import keeper
from .interrupts import held
from .zygotes import fork_keeper

KEEPER_SCRIPT = os.path.abspath(keeper.__file__)  # run by path: it imports nothing of the package


class Keeper:
    """The launcher's handle on a running keeper and its ranks."""

    def __init__(self, folder: str, world_size: int):
        """Nothing runs yet: `start` starts the keeper, `stop` stops whatever `start` got to (nothing, if it was
        interrupted before). `process`: the keeper, a Popen or a `zygotes.Forked` (the zygote forked it)."""
        self.folder, self.world_size, self.process, self.streams = folder, world_size, None, []

    def start(self, env: dict) -> None:
        """Start the keeper, which starts the ranks; `streams[r]` reads rank r's output (stdout and stderr).
        A Ctrl-C waits (`interrupts.held`) until the keeper is `self.process`, so `stop` stops it whenever it lands."""
        with held():
            pipes = [os.pipe() for _ in range(self.world_size)]
            self.streams = [os.fdopen(r, "rb") for r, _ in pipes]
            writers, env = [w for _, w in pipes], dict(env, TOOLKIT_LAUNCHER_PID=str(os.getpid()))
            try:
                self.process = fork_keeper(self.folder, self.world_size, env, writers) or subprocess.Popen(
                    [sys.executable, KEEPER_SCRIPT, self.folder, str(self.world_size), *map(str, writers)],
                    env=env,
                    pass_fds=writers,
                    start_new_session=True,
                    stdin=subprocess.DEVNULL,
                )
            finally:
                for w in writers:
                    os.close(w)

    def exits(self) -> dict[int, tuple[int, float]]:
        """{rank: (exit code, when it ended)} for the ranks that have ended, as the keeper saw them end."""
        found = {}
        for rank in range(self.world_size):
            try:
                with open(os.path.join(self.folder, f"exit-{rank}")) as f:
                    record = json.load(f)
            except (OSError, ValueError):
                continue
            found[rank] = (record["code"], record["time"])
        return found

    def pids(self) -> list[int]:
        try:
            with open(os.path.join(self.folder, "pids.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return []

    def orphaned(self) -> int | None:
        """The pid of the process whose death made the keeper stop everything on its own (None: it did not)."""
        try:
            with open(os.path.join(self.folder, "orphaned")) as f:
                return int(f.read())
        except (OSError, ValueError):
            return None

    def lost(self) -> int | None:
        """The keeper's own exit code if it ended before being told to (None while it runs)."""
        return self.process.poll()

    def stop(self) -> None:
        """Kill every rank and everything they started, then wait for the keeper to finish doing so (`launch`
        holds a Ctrl-C meanwhile: it lands once nothing is left)."""
        if self.process is None:  # never started
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=keeper.KILL_PATIENCE_S + 5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.returncode != 0:  # the keeper was killed from outside: its ranks' groups at least
            ended = self.exits()
            for rank, pid in enumerate(self.pids()):
                if rank not in ended:  # (an ended rank's pid may belong to another process by now)
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
