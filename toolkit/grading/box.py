"""The grading's folder, one per submission, and the grading's fork server that lives as long as it.

`Box` holds `code/` (a copy of the student's file and the lab's `tasks.py`, read-only), `work/` (the submission's
working directory), `tmp/`, `inputs/` (one file per rank: its token for the grader's relay, removed by that rank
before any student code runs), `out/` (what the ranks write) and `lib/` (the students' toolkit for the lab, what
the ranks import). The instructor's lab folder, the other students' files and the grader's results are never in
it. Each launch of the grading (`session.launch_ranks`) is forked by the grading's fork server: one per Box,
forked by the graders' server (`forkserver.py`) with the grading's id in its environment.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ..runtime import zygotes
from ..runtime.interrupts import held, taken
from ..runtime.zygote_link import Zygote, ZygoteError
from . import isolation, namespaces, sandbox, student_wheel, volume
from .limits import Limits

FORKSERVER = str(Path(__file__).resolve().with_name("forkserver.py"))
ID_ROOM = 64  # the longest grading id a grading's server can carry (uuid4().hex: 32)


class Box:
    """The grading's folder. `with Box(lab_dir, source, filename) as box:`; removed on exit. It holds the students'
    toolkit for the lab (`student_wheel.for_lab`: lib/, what the ranks import), and knows who the submission
    runs as (`user`: None, as the grader) and whether this machine gives a launch namespaces of its own.
    Made and removed whole: a Ctrl-C meanwhile waits until it is (`runtime/interrupts.py`), and a Box that could not
    be made removes what it had made (its folder, its volume's holder) before the error reaches the caller."""

    def __init__(self, lab_dir: Path, source: bytes, filename: str, disk_limit_mb: float = Limits.disk_limit_mb):
        self.server: Zygote | None = None  # the grading's fork server, from the first launch
        self.serverless = ""  # why launches start fresh interpreters instead
        self.volume, self.user, self.namespaces = None, None, True  # (what `__exit__` reads, should this fail)
        with held():
            self.root = Path(tempfile.mkdtemp(prefix="toolkit-grade-"))
            try:
                self._fill(Path(lab_dir), source, filename, disk_limit_mb)
            except BaseException:
                self.__exit__()
                raise

    def _fill(self, lab_dir: Path, source: bytes, filename: str, disk_limit_mb: float) -> None:
        self.code, self.work, self.tmp = self.root / "code", self.root / "work", self.root / "tmp"
        self.inputs, self.out = self.root / "inputs", self.root / "out"
        for folder in (self.code, self.work, self.tmp, self.inputs, self.out):
            folder.mkdir()
        self.lab_dir = lab_dir
        self.student = self.code / (filename if filename.endswith(".py") else "submission.py")
        self.student.write_bytes(source)
        self.tasks = self.code / "tasks.py"
        shutil.copyfile(lab_dir / "tasks.py", self.tasks)
        self.lib = self.root / "lib"  # the students' toolkit (cached once per toolkit and lab), copied
        with taken():  # the first grading of a lab builds its students' toolkit (seconds): a Ctrl-C acts at once
            built = student_wheel.for_lab(lab_dir)
        shutil.copytree(built / "toolkit", self.lib / "toolkit")
        self.root.chmod(0o755)
        self.user, self.namespaces = sandbox.other_user(), bool(namespaces.probe())
        self.volume, self.disk = _volumes(self.root, disk_limit_mb)
        sandbox.hand_over([self.seen(f) for f in (self.work, self.tmp, self.inputs, self.out)], self.user)

    def __enter__(self) -> Box:
        return self

    def __exit__(self, *exc) -> None:
        with held():
            if self.server is not None:
                self.server.close()
            if self.volume is not None:  # its bytes go with it
                self.volume.close()
            shutil.rmtree(self.root, ignore_errors=True)
            if not self.namespaces:  # no /tmp and /dev/shm of its own: what the sandbox's user left there goes now
                sandbox.sweep(self.user)

    def fork_server(self, env: dict) -> Zygote | None:
        """The grading's fork server, started on first use; None where none can serve (self.serverless: why)."""
        if self.server is None and not self.serverless:
            why = zygotes.why_not(1)
            if why is None:
                try:
                    self.server = _grading_server(env, str(self.work))
                except (ZygoteError, OSError) as exc:
                    why = f"the grading's fork server could not start ({exc})"
            self.serverless = why or ""
        return self.server

    def seen(self, path) -> Path:
        """Where the grader reads and writes `path`, a path in the grading's writable folders: on their volume
        (`volume.Volume.seen`), or where it lies."""
        return Path(self.volume.seen(path)) if self.volume is not None else Path(path)

    def fresh_out(self) -> None:
        """Empty out/ and inputs/ for the next launch (the folders stay: on a volume, each is a mount point)."""
        for folder in (self.seen(self.out), self.seen(self.inputs)):
            for entry in os.scandir(folder):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
            folder.chmod(0o755)
        sandbox.hand_over([self.seen(self.out), self.seen(self.inputs)], self.user)


def _volumes(root: Path, size_mb: float) -> tuple[volume.Volume | None, str]:
    """The grading's writable folders on volumes of their own, and the report's words for them; where this machine
    allows none, the folders stay on its disk, capped per file only, and the words say so."""
    try:
        made = volume.Volume(str(root), {"written": ["work", "tmp"], "sent": ["inputs", "out"]}, size_mb)
    except OSError as exc:  # volume.Unavailable: the machine allows no namespace for it
        return None, (
            f"its folders on the machine's disk, each file capped at {sandbox.FILE_SIZE_LIMIT // 2**20} MiB but not "
            f"the folders in all (this machine gives a grading no volume of its own: {exc.strerror or exc})"
        )
    return made, (
        f"its folders on volumes of their own: {size_mb:g} MiB and {volume.MAX_FILES} files for what it writes, "
        "as much for what its ranks send back"
    )


def _grading_server(env: dict, cwd: str) -> Zygote:
    """The grading's fork server, forked by the graders' server of this process (`forkserver.py`, started once
    per environment with a blank id that the grading's server overwrites with its own)."""
    common = {k: v for k, v in env.items() if k not in ("HOME", "TMPDIR", "PYTHONPATH")}
    common[isolation.MARKER] = "-" * ID_ROOM
    return Zygote.forked_by(zygotes.server(common, FORKSERVER), {"env": env, "cwd": cwd, "marker": isolation.MARKER})
