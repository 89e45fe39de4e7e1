"""The students' copy of the labs (`python -m toolkit release`), the students' toolkit (`--wheel`) and the
Gradescope set-up.

The release must hold every lab's README, skeleton, tasks and public checks, and nothing of an answer: no
solution file, no hidden checks, no instructors' text, no import of a solution, no line of code only a
solution has, no use of the toolkit's own implementation of what a lab teaches; it refuses a tree whose
skeletons were solved in place. And it must still work: grading the released skeleton gives 0 with the
released checks."""

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from toolkit.grading import grade, lab_checks
from toolkit.grading.release import main as release_main
from toolkit.grading.release import release
from toolkit.grading.student_wheel import for_lab

ROOT = Path(__file__).resolve().parent.parent
LABS = ROOT / "labs"
MIN_LINE = 24


def solution_only(lab: Path) -> set[str]:
    """Written here again, independently of release.py: a solution's lines that the student is not given."""
    given = set()
    for name in ("skeleton.py", "README.md"):
        given |= {line.strip() for line in (lab / name).read_text().splitlines()}
    return {
        line.strip()
        for solution in lab.glob("solution*.py")
        for line in solution.read_text().splitlines()
        if len(line.strip()) >= MIN_LINE
        and not line.strip().startswith(("#", "import ", "from "))
        and line.strip() not in given
    }


@pytest.mark.timeout(300)
def test_release_has_no_answer_and_its_skeleton_still_grades(tmp_path, no_leftover_ranks):
    out = tmp_path / "student-labs"
    assert release_main([str(LABS), "--out", str(out)]) == 0
    labs = sorted(p.name for p in LABS.iterdir() if (p / "checks.py").exists())
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == labs  # autograder/ stays home
    files = [p for p in out.rglob("*") if p.is_file()]
    for lab in labs:
        names = {p.name for p in (out / lab).rglob("*")}
        assert {"README.md", "skeleton.py", "tasks.py", "checks.py"} <= names
        assert not [n for n in names if n.startswith("solution") or n == "hidden_checks.py"], names
    assert not (out / "10-cost-model" / "record_steps.py").exists()  # it computes the answers
    syllabus = (out / "README.md").read_text()
    assert "## For instructors" not in syllabus and "autograder/" not in syllabus
    assert "<!-- instructor -->" not in syllabus.splitlines()  # the markers go with what they mark
    assert "For lab authors" in syllabus
    secrets = {lab: solution_only(LABS / lab) for lab in labs}
    assert all(secrets.values()), "every solution has lines of its own (else this test proves nothing)"
    for path in files:
        text = path.read_text()
        assert not re.search(r"(import|from)\s+[\w.]*solution\b|solution\.py", text) or path.suffix != ".py", path
        lab = path.relative_to(out).parts[0]
        leaked = [line for line in text.splitlines() if line.strip() in secrets.get(lab, ())]
        assert not leaked, f"{path} gives away the solution: {leaked[:3]}"
    released = (out / "10-cost-model" / "checks.py").read_text()  # it names its answers (ANSWERS), never uses them
    for use in (
        "from toolkit.memory.formulas import",
        "from toolkit.sim.timeline import",
        "alpha_beta_time(",
        "schedule(",
    ):
        assert use not in released, use
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
    (lab / "checks.py").write_text(
        "EXPECTED = sum(range(10)) * 42 // 45 + 0\n    return sum(range(10)) * 42 // 45 + 0\n"
    )
    with pytest.raises(ValueError, match="is a line of the solution"):
        release(tmp_path / "labs", tmp_path / "out")
    (lab / "checks.py").write_text(
        'ANSWERS = {"toolkit.comm.ring": "the ring"}\nfrom toolkit.comm.ring import all_reduce as reference\n'
    )
    with pytest.raises(ValueError, match="names toolkit.comm.ring"):
        release(tmp_path / "labs", tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written


def _git(folder: Path, *args):
    subprocess.run(
        ["git", *args],
        cwd=folder,
        check=True,
        capture_output=True,
        env=dict(
            os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t"
        ),
    )


def test_release_refuses_a_skeleton_solved_in_place(tmp_path):
    labs = tmp_path / "labs"
    shutil.copytree(LABS / "10-cost-model", labs / "10-cost-model")
    _git(labs, "init", "-q")
    _git(labs, "add", "-A")
    _git(labs, "commit", "-qm", "the labs")
    skeleton = labs / "10-cost-model" / "skeleton.py"
    skeleton.write_text((labs / "10-cost-model" / "solution.py").read_text())  # filled in where it stands
    with pytest.raises(ValueError, match="skeleton.py differs from the committed one"):
        release(labs, tmp_path / "out")
    shutil.rmtree(labs / ".git")  # outside git: a skeleton that leaves nothing to write is refused too
    with pytest.raises(ValueError, match="leaves nothing to write"):
        release(labs, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(300)
def test_the_students_wheel_holds_no_answer(tmp_path):
    out = tmp_path / "student-labs"
    assert release_main([str(LABS), "--out", str(out), "--labs", "01-ring-allreduce", "10-cost-model", "--wheel"]) == 0
    (wheel,) = (out / "wheel").glob("distributed_training_toolkit-*+student-*.whl")
    with zipfile.ZipFile(wheel) as z:
        ring = z.read("toolkit/comm/ring.py").decode()
        timeline = z.read("toolkit/sim/timeline.py").decode()
        names = z.namelist()
    assert "batch_isend_irecv" not in ring and ring.count("raise NotImplementedError") >= 5
    assert (
        "free.get(link" not in timeline and "toolkit.sim.timeline.schedule is not in the students' toolkit" in timeline
    )
    assert not [n for n in names if n.startswith("labs/") or "solution" in n]
    left = (out / "wheel" / "LEFT-OUT.txt").read_text()
    assert "toolkit.comm.ring.all_reduce" in left and "toolkit.memory.formulas.alpha_beta_time" in left
    assert not [n for n in (out).iterdir() if n.name == "03-fsdp-unit"]  # only the labs asked for
    installed = tmp_path / "installed"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(installed)
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import toolkit, toolkit.comm.ring as r, toolkit.parallel\n"
            "try:\n    r.all_reduce(None, None)\nexcept NotImplementedError as e:\n    print(e)",
        ],
        env=dict(os.environ, PYTHONPATH=str(installed)),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "is not in the students' toolkit: it is the answer to a lab" in done.stdout, done.stderr


def test_released_files_carry_no_answers(tmp_path):
    """Lab 12's warm-up formula and lab 10's expected values stay with the instructor; a lab with hidden checks is
    released with their names and points (platform_checks.json), so the local grading can say they exist."""
    out = tmp_path / "student-labs"
    release(LABS, out)
    released = {p.relative_to(out).as_posix(): p.read_text() for p in out.rglob("*") if p.is_file()}
    lab12 = "\n".join(text for name, text in released.items() if name.startswith("12-pipeline/"))
    assert "pp - rank - 1" not in lab12 and "warmup = " not in lab12
    steps = released["10-cost-model/steps.json"]
    assert '"expected"' not in steps and '"mistakes"' not in steps and '"step"' not in steps
    assert not [name for name in released if "equivalent_mutants" in name or "hidden_checks" in name]
    for lab in ("05-shadowing", "09-tutel-pipeline", "10-cost-model", "12-pipeline"):
        listed = json.loads(released[f"{lab}/platform_checks.json"])
        hidden = [c for c in lab_checks(LABS / lab)[0] if c.hidden]
        assert [(c["name"], c["points"]) for c in listed] == [(c.name, c.points) for c in hidden]
    checks, _ = lab_checks(out / "12-pipeline")
    assert [c.name for c in checks if c.platform_only] == [
        c.name for c in lab_checks(LABS / "12-pipeline")[0] if c.hidden
    ]


def test_the_students_toolkit_keeps_no_answer_under_another_name_or_in_a_docstring(tmp_path):
    """Lab 12's 1F1B is taken out with its docstring, and so is the interleaved schedule (1F1B with another warm-up);
    lab 04's all-to-all is taken out where it is defined (the layer only re-exports it); the tree is cached."""
    tree = for_lab(LABS / "12-pipeline")
    assert for_lab(LABS / "12-pipeline") == tree  # the same content: built once
    schedules = (tree / "toolkit" / "parallel" / "pipeline" / "schedules.py").read_text()
    body = schedules[schedules.index("def one_f_one_b") : schedules.index("def zb_h1")]
    assert "warm-up" not in body and "rank - 1" not in body and body.count("raise NotImplementedError") == 2
    assert "def gpipe" in schedules and 'Action("F", i, rank) for i in range(microbatches)' in schedules
    exchange = (for_lab(LABS / "04-moe-dispatch") / "toolkit" / "moe" / "exchange.py").read_text()
    assert "swapped" not in exchange.split("class _AllToAll")[1] and "ctx.in_splits, ctx.out_splits" not in exchange
    ring = (for_lab(LABS / "01-ring-allreduce") / "toolkit" / "comm" / "ring.py").read_text()
    assert ring.startswith('"""toolkit.comm.ring: not in the students\' toolkit') and "(r - s - 1)" not in ring
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from toolkit.parallel.pipeline import schedules\n"
            "try:\n    schedules.build('1f1b', 2, 4)\nexcept NotImplementedError as e:\n    print(e)",
        ],
        env=dict(os.environ, PYTHONPATH=str(tree)),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "one_f_one_b is not in the students' toolkit" in done.stdout, (done.stdout, done.stderr)


@pytest.mark.timeout(300)
def test_gradescope_run_autograder_writes_results_json(tmp_path, no_leftover_ranks):
    root = tmp_path / "autograder"
    (root / "source" / "labs").mkdir(parents=True)
    (root / "submission").mkdir()
    (root / "source" / "labs" / "02-ddp-buckets").symlink_to(LABS / "02-ddp-buckets")
    (root / "source" / "LAB").write_text("02-ddp-buckets\n")
    shutil.copy(LABS / "02-ddp-buckets" / "skeleton.py", root / "submission" / "my_buckets.py")
    env = dict(os.environ, AUTOGRADER_ROOT=str(root), PYTHON=sys.executable)
    done = subprocess.run(
        [str(LABS / "autograder" / "run_autograder")], env=env, capture_output=True, text=True, timeout=170
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "", done.stdout  # --quiet is quiet
    results = json.loads((root / "results" / "results.json").read_text())
    assert results["score"] == 0 and results["max_score"] == 11
    assert len(results["tests"]) == 7 and all(t["status"] == "failed" for t in results["tests"])
    assert all("not implemented yet" in t["output"] for t in results["tests"])


@pytest.mark.grading_scale  # every lab graded once against the students' wheel: minutes (`make test-grading`)
@pytest.mark.timeout(1800)
def test_every_labs_reference_scores_full_marks_with_the_students_wheel(tmp_path, no_leftover_ranks):
    """What the wheel keeps is enough: an answer another lab runs on (BUILDS_ON) stays, and with the students'
    toolkit each lab's reference, graded from the released copy, scores full marks (the public checks)."""
    out = tmp_path / "student-labs"
    assert release_main([str(LABS), "--out", str(out), "--wheel"]) == 0
    installed = tmp_path / "installed"
    with zipfile.ZipFile(next((out / "wheel").glob("*.whl"))) as z:
        z.extractall(installed)
    for lab in sorted(p.name for p in out.iterdir() if (p / "checks.py").exists()):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "toolkit",
                "grade",
                str(out / lab),
                "--solution",
                str(LABS / lab / "solution.py"),
                "--format",
                "json",
                "--quiet",
            ],
            env=dict(os.environ, PYTHONPATH=str(installed)),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
        )
        report = json.loads(done.stdout)
        assert report["score"] == report["max_score"], (lab, [c for c in report["checks"] if not c["passed"]])
