"""The toolkit a grading's ranks import: the students' build, with the lab's answers taken out.

What students install (`release --wheel`) is the toolkit without the labs' answers; the ranks that run a
submission import the same, made from the grader's toolkit by the same code (`student_wheel.strip`) for the
lab being graded: its `ANSWERS` taken out, but those it `BUILDS_ON`. No answer is then in a rank's process or
readable from it (the full toolkit is hidden from the sandbox: `sandbox.toolkits`), so no door
(`toolkit.comm.use("ring")`), closure or table of the toolkit leads to one; the delegation watcher stays as a
second line, which says why a check scored 0 (`delegation.py`).

Built once per toolkit (a hash of its files) and set of answers, compiled, and kept in a cache (`cache_root`);
each grading copies it into its own folder, where the sandbox's user can read it. `python -m toolkit grade LAB
--prepare` builds it ahead of the first grading (Gradescope's setup.sh does, when the image is built).
"""
from __future__ import annotations

import compileall
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc")


def cache_root() -> Path:
    """TOOLKIT_CACHE, else $XDG_CACHE_HOME/toolkit, else ~/.cache/toolkit; then students-build/."""
    base = os.environ.get("TOOLKIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "toolkit")
    return Path(base) / "students-build"


def _package() -> Path:
    import toolkit

    return Path(toolkit.__file__).resolve().parent


def fingerprint(answers, builds_on) -> str:
    """What a build depends on: every file of the toolkit, the answers taken out and kept, the interpreter."""
    digest = hashlib.sha256(repr((sorted(answers), sorted(builds_on), sys.version)).encode())
    package = _package()
    for path in sorted(package.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:24]


def build(answers, builds_on=()) -> Path:
    """The cached folder holding the toolkit without `answers` (but `builds_on`), built if missing."""
    from .student_wheel import strip

    answers = sorted(s for s in answers if s.startswith("toolkit."))
    root = cache_root()
    done = root / fingerprint(answers, builds_on)
    if (done / "toolkit" / "__init__.py").is_file():
        return done
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    making = Path(tempfile.mkdtemp(prefix=f"{done.name}.building-", dir=root))
    try:
        shutil.copytree(_package(), making / "toolkit", ignore=IGNORED)
        strip(making, answers, builds_on)
        compileall.compile_dir(making / "toolkit", quiet=2, workers=1)
        try:
            os.rename(making, done)  # whole or not at all; another grading may have built it meanwhile
        except OSError:
            if not (done / "toolkit" / "__init__.py").is_file():
                raise
    finally:
        shutil.rmtree(making, ignore_errors=True)
    return done


def for_lab(lab_dir) -> Path:
    """The students' build for the lab in `lab_dir` (its checks.py's ANSWERS, but its BUILDS_ON)."""
    from .release import declared

    lab_dir = Path(lab_dir)
    return build(declared(lab_dir, "ANSWERS", {}), declared(lab_dir, "BUILDS_ON", []))


def copy_into(built: Path, folder: Path) -> Path:
    """A copy of the build in `folder` (created), readable by every user: what a grading's ranks import."""
    shutil.copytree(built, folder, copy_function=shutil.copy2)
    for root, dirs, files in os.walk(folder):
        os.chmod(root, 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    return folder
