"""Grade a whole class in one command: one process per submission, a CSV of scores, a progress bar.

    python -m toolkit grade labs/01-ring-allreduce --class submissions/ --csv scores.csv --out feedback/

`submissions/` holds one file per student (`alice.py`) or one folder per student (`alice/ring.py`, the
layout of a Gradescope or LMS export; the folder's only .py file, or the one named by `--file`).
Every submission is read into memory before any is run, and each is graded from a private copy of those
bytes by its own `python -m toolkit grade ... --format json` process in a fresh session, with a wall-clock
limit (`student_timeout_s`): whatever one submission does (hang, deadlock, fork, eat memory, write to
other students' files), it costs at most that limit, it changes no other student's grade, and every
process it started is killed before the next one begins (`isolation.stop`): a grading that runs out of time is first
interrupted as a Ctrl-C interrupts it, so that it removes the folders it made. The class folder itself is
out of the submissions' reach where the machine allows a sandbox (`sandbox.py`); `grade_class` refuses
to run without one unless `allow_unsandboxed`. `jobs` > 1 grades that many students at once (a machine
with more cores than one grading's ranks use), where each grading has a PID namespace of its own.

The CSV has one row per student: student, score, max_score, status ("graded", "timed out", "no
file", "refused: ..." (a link, a FIFO, a file too big: never followed or read), "grader error"), seconds, file,
then the points of every check. With `out_dir`, each student's
full report (every check's message) is written there as `<student>.json`.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..runtime import interrupts
from . import isolation, namespaces, sandbox, untrusted
from .untrusted import clean

GRACE_S = 20.0  # a timed-out grading's time to stop itself once interrupted (stopping a launch takes 15 s at most)


@dataclass
class Row:
    student: str
    file: str
    status: str = "graded"
    score: float = 0
    max_score: float = 0
    seconds: float = 0.0
    checks: dict = field(default_factory=dict)  # check name -> points earned
    report: dict | None = None


def submissions(class_dir, filename: str | None = None) -> list[tuple[str, Path | None]]:
    """(student, file) for every submission in `class_dir`, sorted by student; file None if not found. A link
    (a student's file or folder, or a file in it) is listed as it is, never followed: `read` refuses it."""
    found = []
    for entry in sorted(Path(class_dir).iterdir()):
        if entry.suffix == ".py" and (entry.is_symlink() or entry.is_file()):
            found.append((entry.stem, entry))
        elif entry.is_symlink() and not entry.name.startswith("."):
            found.append((entry.name, entry))  # a student's folder that is a link: refused, by name
        elif entry.is_dir() and not entry.name.startswith("."):
            files = [entry / filename] if filename else sorted(entry.glob("*.py"))
            files = [f for f in files if f.is_symlink() or f.is_file()]
            found.append((entry.name, files[0] if len(files) == 1 else None))
    return found


def read(file: Path | None) -> tuple[bytes | None, str]:
    """(the submission's bytes, "") or (None, why it is refused): only a regular file, never through a link."""
    if file is None:
        return None, ""
    try:
        return untrusted.read(file, what="the submission"), ""
    except OSError as exc:
        return None, f"refused: {exc}" if isinstance(exc, untrusted.Refused) else f"refused: cannot read it ({exc})"


def grade_one(
    lab,
    student: str,
    file: Path | None,
    source: bytes | None,
    refused: str = "",
    *,
    student_timeout_s: float,
    options: list[str],
) -> Row:
    """Grade one submission (`source`, the bytes read from `file` before any submission ran) in its own
    process and session; nothing it starts survives."""
    row = Row(student, str(file or ""))
    if file is None or source is None:
        row.status = refused or "no file"
        return row
    grading_id = uuid.uuid4().hex
    env = dict(os.environ, **{isolation.MARKER: grading_id})
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="toolkit-class-") as tmp:
        output, errors = os.path.join(tmp, "result.json"), os.path.join(tmp, "stderr.txt")
        copy = Path(tmp) / "submission" / file.name
        copy.parent.mkdir()
        copy.write_bytes(source)
        command = [
            sys.executable,
            "-m",
            "toolkit",
            "grade",
            str(Path(lab).resolve()),
            "--solution",
            str(copy),
            "--format",
            "json",
            "--output",
            output,
            "--quiet",
            *options,
        ]
        # a Ctrl-C waits until the child is held by the `finally` that stops it (`runtime/interrupts.py`)
        with open(errors, "wb") as err, interrupts.held():  # a file, not a pipe: an escapee must not hold us up
            process = subprocess.Popen(
                command,
                env=env,
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                cwd=tmp,
            )
            try:
                with interrupts.taken():
                    process.wait(timeout=student_timeout_s)
            except subprocess.TimeoutExpired:
                row.status = f"timed out after {student_timeout_s:.0f} s"
                _interrupt(process)
            finally:
                try:
                    os.killpg(process.pid, signal.SIGKILL)  # its session's process group, whatever is left
                except ProcessLookupError:
                    pass
                process.wait()
                isolation.stop(grading_id)  # and whatever left the group, by the id in its environment
        row.seconds = round(time.monotonic() - started, 1)
        # past the limit, what the grading wrote while it was stopped is no grade
        report = _load(output) if row.status == "graded" else None
        err = untrusted.tail(errors, 2000)
    if report is not None:
        report["solution"] = str(file)
        row.report, row.score, row.max_score = report, report["score"], report["max_score"]
        row.checks = {c["name"]: c["score"] for c in report["checks"]}
    elif row.status == "graded":
        row.status = "grader error"
        row.report = {"error": err.decode(errors="replace")[-2000:]}
    return row


def _interrupt(process: subprocess.Popen) -> None:
    """Stop a timed-out grading as a Ctrl-C stops it, for at most GRACE_S: the grader (ours, not the student's) stops
    its ranks and removes what it made (its folder, its volume, what the sandbox's user left in /tmp). A SIGKILL
    alone would leave those behind; whatever is still running after the grace is killed all the same."""
    with interrupts.taken():
        try:
            process.send_signal(signal.SIGINT)
            process.wait(timeout=GRACE_S)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass


def _load(path: str):
    try:
        return json.loads(untrusted.read(path, what="a report"))
    except (OSError, ValueError):
        return None


def grade_class(
    lab,
    class_dir,
    csv_path,
    *,
    out_dir=None,
    filename: str | None = None,
    student_timeout_s: float = 600.0,
    jobs: int = 1,
    options: list[str] = (),
    progress: bool = True,
    allow_unsandboxed: bool = False,
) -> list[Row]:
    """Grade every submission in `class_dir` against `lab`; write the CSV (and the reports); return rows."""
    from tqdm.auto import tqdm

    if not sandbox.isolated() and not allow_unsandboxed:
        raise ValueError(
            "this machine gives a submission no filesystem sandbox (no Linux landlock, and not "
            "root): one student's code could read or change the class folder. Grade on Linux 5.13+, "
            "or as root, or pass --allow-unsandboxed if you trust every submission."
        )
    if jobs > 1 and not allow_unsandboxed and namespaces.OWN_PIDS not in namespaces.probe():
        raise ValueError(
            f"--jobs {jobs} grades {jobs} submissions at once, and this machine gives a grading no PID namespace of "
            "its own: they would run side by side as one user, and one student's code could signal or read another's "
            "ranks and change that grade. Grade one at a time (--jobs 1, the default), on a machine that allows user "
            "namespaces, or pass --allow-unsandboxed if you trust every submission."
        )
    work = [(student, file, *read(file)) for student, file in submissions(class_dir, filename)]
    if not work:
        raise FileNotFoundError(f"{class_dir} holds no submissions (.py files, or one folder per student).")
    rows: list[Row] = []
    bar = tqdm(total=len(work), desc="grading", unit="student", disable=not progress, file=sys.stderr)

    def one(item):
        return grade_one(lab, *item, student_timeout_s=student_timeout_s, options=list(options))

    from .grader import lab_checks

    maximum = sum(c.points for c in lab_checks(lab)[0])
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for row in pool.map(one, work):
            row.max_score = row.max_score or maximum
            rows.append(row)
            bar.set_postfix_str(f"{row.student}: {row.score:g}/{row.max_score:g} {row.status}"[:60])
            bar.update()
    bar.close()
    write_csv(rows, csv_path)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        for row in rows:
            (Path(out_dir) / f"{row.student}.json").write_text(
                json.dumps({"student": row.student, "status": row.status, **(row.report or {})}, indent=2)
            )
    return rows


def _cell(text) -> str:
    """A name or status as a CSV cell: shown as it is, never a formula a spreadsheet would evaluate (a student's
    file named `=HYPERLINK(...).py`): a cell that starts like one starts with a quote."""
    text = clean(text)
    return "'" + text if text[:1] in ("=", "+", "-", "@") else text


def write_csv(rows: list[Row], path) -> None:
    names = []
    for row in rows:
        names += [n for n in row.checks if n not in names]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student", "score", "max_score", "status", "seconds", "file", *names])
        for r in rows:  # names and statuses come from the class folder: shown, never able to change the table's look
            writer.writerow(
                [
                    _cell(r.student),
                    r.score,
                    r.max_score,
                    _cell(r.status),
                    r.seconds,
                    _cell(r.file),
                    *[r.checks.get(n, 0) for n in names],
                ]
            )
