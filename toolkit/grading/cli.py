"""`python -m toolkit grade`: one solution, or a whole class, in the form a person or a platform reads.

    python -m toolkit grade labs/01-ring-allreduce                                   # the skeleton, as text
    python -m toolkit grade labs/01-ring-allreduce --solution mine.py --format json
    python -m toolkit grade labs/01-ring-allreduce --solution mine.py --format gradescope \\
        --output /autograder/results/results.json
    python -m toolkit grade labs/01-ring-allreduce --class submissions/ --csv scores.csv --out feedback/

Exit codes: 0 full marks, 1 graded but not full marks, 2 bad arguments or missing files, 3 the grader
failed (see `report.py`). With --class: 0 when every submission was graded (whatever the scores),
1 when some timed out or had no file, 3 when the grader failed on some.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from . import isolation, report
from .grader import grade
from .limits import Limits
from .sandbox import Unsafe
from .untrusted import clean


def grade_command(
    lab_path,
    solution=None,
    *,
    check_timeout_s: float = 20.0,
    quiet: bool = False,
    fmt: str = "text",
    output=None,
    limits: Limits | None = None,
) -> int:
    """Grade one solution; print (or write to `output`) the report in `fmt`; return the exit code.
    With `output`, a report is written whatever happens: a score, or a score of 0 saying why there is none."""
    started = time.monotonic()
    try:
        score = grade(lab_path, solution, check_timeout_s=check_timeout_s, quiet=quiet, limits=limits)
    except (FileNotFoundError, ValueError) as exc:
        return _nothing_graded(f"error: {exc}", fmt, output, report.USAGE_ERROR)
    except Unsafe as exc:  # the machine, not the solution: nothing was run, and the instructor is told what to change
        return _nothing_graded(f"error: {exc}", fmt, output, report.GRADER_ERROR)
    except BaseException:  # noqa: BLE001 - the grader's own failure, not the student's: say so, distinctly
        return _nothing_graded(
            "error: the grader itself failed (not a problem of the solution graded):\n" + traceback.format_exc(),
            fmt,
            output,
            report.GRADER_ERROR,
        )
    text = report.render(score, fmt, time.monotonic() - started)
    if output:  # the report goes there instead of to stdout; a person running it is told where, on stderr
        _write(output, text)
        if not quiet:
            print(f"grading: the report ({fmt}) is in {output}: {score.total}/{score.maximum}", file=sys.stderr)
    else:
        print(text)
    return report.exit_code(score)


def _write(path, text: str) -> None:
    """Whole or not at all: a reader never sees half a report, and a planted link is replaced, not followed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text + "\n")
    os.replace(partial, path)


def _nothing_graded(message: str, fmt: str, output, code: int) -> int:
    print(clean(message), file=sys.stderr)
    if output:
        _write(
            output,
            report.nothing_graded(
                message.splitlines()[0]
                if code == report.USAGE_ERROR
                else "The autograder could not grade this submission (the grader failed, "
                "not your code). Please tell the course staff.",
                fmt,
            ),
        )
    return code


def prepare_command(lab) -> int:
    """Build (or find in the cache) the students' toolkit for `lab`, before any grading needs it."""
    from .grader import not_a_lab
    from .student_wheel import for_lab

    folder = Path(lab)
    if not (folder / "checks.py").is_file():
        print(f"error: {not_a_lab(folder, 'checks.py')}", file=sys.stderr)
        return report.USAGE_ERROR
    print(f"the students' toolkit for {lab} (what its ranks import): {for_lab(folder)}")
    return 0


def class_command(
    lab,
    class_dir,
    csv_path,
    *,
    out_dir=None,
    filename=None,
    student_timeout_s=600.0,
    jobs=1,
    options=(),
    allow_unsandboxed=False,
    quiet=False,
) -> int:
    from .classroom import grade_class

    try:
        rows = grade_class(
            lab,
            class_dir,
            csv_path,
            out_dir=out_dir,
            filename=filename,
            student_timeout_s=student_timeout_s,
            jobs=jobs,
            options=options,
            allow_unsandboxed=allow_unsandboxed,
            progress=not quiet,
        )
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return report.USAGE_ERROR
    statuses = [r.status for r in rows]
    if not quiet:
        print(f"graded {statuses.count('graded')} of {len(rows)} submissions; scores in {csv_path}")
    if "grader error" in statuses:
        return report.GRADER_ERROR
    return 0 if all(s == "graded" for s in statuses) else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m toolkit grade",
        description="Grade a lab on real ranks.",
        epilog="Exit codes: 0 full marks, 1 not full marks, 2 usage error, 3 grader error.",
    )
    parser.add_argument("lab", help="the lab folder, e.g. labs/01-ring-allreduce")
    parser.add_argument("--solution", help="the file to grade (default: the lab's skeleton.py)")
    parser.add_argument(
        "--format",
        choices=report.FORMATS,
        default="text",
        help="text (for a person), json, or gradescope (results.json)",
    )
    parser.add_argument("--output", help="write the report here instead of printing it")
    parser.add_argument("--class", dest="class_dir", help="grade every submission in this folder")
    parser.add_argument("--csv", default="scores.csv", help="with --class: where the scores go")
    parser.add_argument("--out", help="with --class: a folder for every student's full JSON report")
    parser.add_argument("--file", help="with --class: the file name inside each student's folder")
    parser.add_argument(
        "--student-timeout", type=float, default=600.0, help="with --class: seconds one submission may take in all"
    )
    parser.add_argument("--jobs", type=int, default=1, help="with --class: submissions graded at once")
    parser.add_argument(
        "--allow-unsandboxed",
        action="store_true",
        help="with --class: grade even where no filesystem sandbox is available",
    )
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds one rank may wait on a message")
    parser.add_argument(
        "--stall",
        type=float,
        default=Limits.stall_s,
        help="seconds every rank may be blocked before it is called a deadlock",
    )
    parser.add_argument("--time-limit", type=float, default=Limits.time_limit_s, help="seconds one check may run")
    parser.add_argument(
        "--memory-limit",
        type=float,
        default=Limits.memory_limit_mb,
        help="MiB a rank may allocate beyond what it starts with (0: no limit)",
    )
    parser.add_argument(
        "--output-limit",
        type=float,
        default=Limits.output_limit_mb,
        help="MiB the ranks of one launch may print (the launch is stopped past it)",
    )
    parser.add_argument(
        "--disk-limit",
        type=float,
        default=Limits.disk_limit_mb,
        help="MiB the submission's folders may hold in all (and as much what its ranks send back)",
    )
    parser.add_argument(
        "--prepare",
        action="store_true",
        help="build the students' toolkit for this lab (what the ranks import: the lab's answers "
        "taken out), kept in a cache for every grading after, and exit",
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="print nothing but the report (none with --output): not what the ranks print, no progress",
    )
    args = parser.parse_args(argv)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN and threading.current_thread() is threading.main_thread():
        # started as a shell's background job, which ignores SIGINT: a grading still stops cleanly when interrupted,
        # as a class grading stops one that timed out (`classroom._interrupt`)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if not args.disk_limit > 0:
        parser.error(f"--disk-limit must be a positive number of MiB, got {args.disk_limit:g}")
    limits = Limits(
        args.timeout,
        args.stall,
        args.time_limit,
        args.memory_limit or None,
        output_limit_mb=args.output_limit,
        disk_limit_mb=args.disk_limit,
    )
    if args.prepare:
        return prepare_command(args.lab)
    if args.class_dir:
        if args.solution:
            parser.error("give --solution or --class, not both")
        options = [
            "--timeout",
            str(args.timeout),
            "--stall",
            str(args.stall),
            "--time-limit",
            str(args.time_limit),
            "--memory-limit",
            str(args.memory_limit or 0),
            "--output-limit",
            str(args.output_limit),
            "--disk-limit",
            str(args.disk_limit),
        ]
        return class_command(
            args.lab,
            args.class_dir,
            args.csv,
            out_dir=args.out,
            filename=args.file,
            student_timeout_s=args.student_timeout,
            jobs=args.jobs,
            options=options,
            allow_unsandboxed=args.allow_unsandboxed,
            quiet=args.quiet,
        )
    whole_process = _is_the_command_line()
    if whole_process:  # whatever the solution orphans is re-parented here, and killed below
        isolation.become_subreaper()
    try:
        return grade_command(
            args.lab,
            args.solution,
            check_timeout_s=args.timeout,
            quiet=args.quiet,
            fmt=args.format,
            output=args.output,
            limits=limits,
        )
    finally:
        if whole_process:
            isolation.stop(None, all_children=True)


def _is_the_command_line() -> bool:
    """True in `python -m toolkit grade` (this process exists only to grade); False when called from a
    notebook or a test, whose own child processes are none of the grader's business."""
    main_module = sys.modules.get("__main__")
    spec = getattr(main_module, "__spec__", None)
    return getattr(spec, "name", None) == "toolkit.__main__" or Path(sys.argv[0]).name == "toolkit"
