"""The toolkit a grading's ranks import: the students' build, with the lab's answers taken out.

What students install (`release --wheel`) is the toolkit without the labs' answers; the ranks that run a
submission import the same tree, made from the grader's toolkit by the same code (`student_wheel.for_lab`) for
the lab being graded: its `ANSWERS` taken out, but those it `BUILDS_ON`. No answer is then in a rank's process or
readable from it (the full toolkit is hidden from the sandbox: `sandbox.toolkits`), so no door
(`toolkit.comm.use("ring")`), closure or table of the toolkit leads to one; the delegation watcher stays as a
second line, which says why a check scored 0 (`delegation.py`).

The tree is built once per content and cached by `student_wheel`; each grading copies it into its own folder,
where the sandbox's user can read it. `python -m toolkit grade LAB --prepare` builds it ahead of the first
grading (Gradescope's setup.sh does, when the image is built).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from .student_wheel import for_lab  # noqa: F401 - the build a grading of a lab imports


def copy_into(built: Path, folder: Path) -> Path:
    """A copy of the build in `folder` (created), readable by every user: what a grading's ranks import."""
    shutil.copytree(built, folder, copy_function=shutil.copy2)
    for root, dirs, files in os.walk(folder):
        os.chmod(root, 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    return folder
