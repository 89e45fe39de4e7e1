"""The students' copy of the labs (`python -m toolkit release`) and the Gradescope set-up.

The release must hold every lab's README, skeleton and public checks, and nothing of a solution: no
solution file, no hidden checks, no import of a solution, no line of code only a solution has. And it
must still work: grading the released skeleton gives 0 with the released checks."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.grading import grade
from toolkit.grading.release import main as release_main, release

ROOT = Path(__file__).resolve().parent.parent
LABS = ROOT / "labs"
MIN_LINE = 24


def solution_only(lab: Path) -> set[str]:
    """Written here again, independently of release.py: a solution's lines that the student is not given."""
    given = set()
    for name in ("skeleton.py", "README.md"):
        given |= {line.strip() for line in (lab / name).read_text().splitlines()}
    return {line.strip() for solution in lab.glob("solution*.py") for line in solution.read_text().splitlines()
            if len(line.strip()) >= MIN_LINE and not line.strip().startswith(("#", "import ", "from "))
            and line.strip() not in given}


@pytest.mark.timeout(90)
def test_release_has_no_solution_and_its_skeleton_still_grades(tmp_path, no_leftover_ranks):
    out = tmp_path / "student-labs"
    assert release_main([str(LABS), "--out", str(out)]) == 0
    labs = sorted(p.name for p in LABS.iterdir() if (p / "checks.py").exists())
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == labs  # autograder/ stays home
    files = [p for p in out.rglob("*") if p.is_file()]
    assert (out / "README.md").exists()
    for lab in labs:
        names = {p.name for p in (out / lab).rglob("*")}
        assert {"README.md", "skeleton.py", "checks.py"} <= names
        assert not [n for n in names if n.startswith("solution") or n == "hidden_checks.py"], names
    secrets = {lab: solution_only(LABS / lab) for lab in labs}
    assert all(secrets.values()), "every solution has lines of its own (else this test proves nothing)"
    for path in files:
        text = path.read_text()
        assert not re.search(r"(import|from)\s+[\w.]*solution\b|solution\.py", text) or path.suffix != ".py", path
        lab = path.relative_to(out).parts[0]
        leaked = [line for line in text.splitlines() if line.strip() in secrets.get(lab, ())]
        assert not leaked, f"{path} gives away the solution: {leaked[:3]}"
    score = grade(out / "06-zero")  # the released skeleton, graded with the released checks
    assert score.total == 0 and score.maximum == 8
    assert all("not implemented yet" in r.message for r in score.results)


def test_release_refuses_to_give_a_solution_away(tmp_path):
    lab = tmp_path / "labs" / "99-leaky"
    lab.mkdir(parents=True)
    (lab / "skeleton.py").write_text("def answer():\n    raise NotImplementedError\n")
    (lab / "README.md").write_text("# Lab 99\n")
    (lab / "solution.py").write_text("def answer():\n    return sum(range(10)) * 42 // 45 + 0\n")
    (lab / "checks.py").write_text("from solution import answer  # compare with the reference\n")
    with pytest.raises(ValueError, match="refers to a solution"):
        release(tmp_path / "labs", tmp_path / "out")
    (lab / "checks.py").write_text("EXPECTED = sum(range(10)) * 42 // 45 + 0\n"
                                   "    return sum(range(10)) * 42 // 45 + 0\n")
    with pytest.raises(ValueError, match="is a line of the solution"):
        release(tmp_path / "labs", tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.timeout(120)
def test_gradescope_run_autograder_writes_results_json(tmp_path, no_leftover_ranks):
    root = tmp_path / "autograder"
    (root / "source").mkdir(parents=True)
    (root / "submission").mkdir()
    (root / "source" / "labs").symlink_to(LABS)
    (root / "source" / "LAB").write_text("02-ddp-buckets\n")
    shutil.copy(LABS / "02-ddp-buckets" / "skeleton.py", root / "submission" / "my_buckets.py")
    env = dict(os.environ, AUTOGRADER_ROOT=str(root), PYTHON=sys.executable)
    done = subprocess.run([str(LABS / "autograder" / "run_autograder")], env=env, capture_output=True, text=True,
                          timeout=110)
    assert done.returncode == 0, done.stderr
    results = json.loads((root / "results" / "results.json").read_text())
    assert results["score"] == 0 and results["max_score"] == 10
    assert len(results["tests"]) == 6 and all(t["status"] == "failed" for t in results["tests"])
    assert all("not implemented yet" in t["output"] for t in results["tests"])
