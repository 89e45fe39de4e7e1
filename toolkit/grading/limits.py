"""What grading one solution may cost: the limits an instructor sets (`--timeout`, `--time-limit` and the other
flags of `python -m toolkit grade`; `Limits(...)` in Python), each enforced from outside the submission's processes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """What grading one solution may cost. check_timeout_s: how long one rank waits for one message;
    stall_s: every rank blocked (or done) this long is a deadlock; time_limit_s: one check's wall time (and
    the import's); memory_limit_mb: the data a rank may allocate beyond what it had when the submission was
    imported (None: no limit); max_processes: processes the grading may hold at once (the grader stops it
    past that, root or not); output_limit_mb: what the ranks of a launch may print (the grader stops the
    launch past it); disk_limit_mb: what the submission's folders (its working folder and TMPDIR) may hold in
    all, and apart what its ranks send back (`volume.py`; each file is capped too: `sandbox.FILE_SIZE_LIMIT`).
    None of them is enforced inside the submission's processes (`overseer.py`, `sandbox`, `volume`)."""

    check_timeout_s: float = 20.0
    stall_s: float = 5.0
    time_limit_s: float = 120.0
    memory_limit_mb: float | None = 4096
    max_processes: int = 512
    output_limit_mb: float = 8.0
    disk_limit_mb: float = 256.0
