"""A grading's folders are capped in all, not per file (issue 29): a submission that writes many files, each under
the per-file cap, fills only its own volume (`toolkit/grading/volume.py`), and the grading says which limit it hit;
the machine's disk, the grader and the other gradings are untouched, and nothing is left behind."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_grading_attacks import SOLUTION, make_lab

from toolkit.grading import Limits, box, grade, main, volume

AT_SCALE = pytest.mark.grading_scale

# each file a tenth of the cap, far under the per-file one (256 MiB); together twice the cap
FILLS = SOLUTION.replace(
    "    return xs.sum()",
    """    for i in range(len(os.listdir(".")), 20):
        with open(f"junk-{i}", "wb") as f:
            f.write(b"x" * (2**20 * 8 // 10))
    return xs.sum()""",
).replace("import torch.distributed as dist", "import os\nimport torch.distributed as dist")


# the holder as it runs where no user namespace can be made (the grader then needs CAP_SYS_ADMIN)
NO_USER_NAMESPACE = volume.HOLDER.replace(
    "volume.hold(",
    "real = volume._unshare\nvolume._unshare = lambda f: False if f & volume.CLONE_NEWUSER else real(f)\nvolume.hold(",
)
JOINS = """
import os, sys
sys.path.insert(0, sys.argv[1])
import volume
os.chdir(sys.argv[2])
volume.join(int(sys.argv[3]))
print(sorted(os.listdir(".")), os.getcwd())
"""


def _volume_or_skip(tmp_path) -> volume.Volume:
    for name in ("work", "out"):
        (tmp_path / name).mkdir()
    try:
        return volume.Volume(str(tmp_path), {"written": ["work"], "sent": ["out"]}, 1)
    except volume.Unavailable as exc:
        pytest.skip(f"this machine gives a grading no volume of its own: {exc}")


@pytest.mark.parametrize("holder", ["user and mount namespaces", "a mount namespace alone"])
def test_a_volume_caps_bytes_and_files_in_all_and_leaves_nothing(holder, tmp_path, monkeypatch):
    """Bytes past the size and files past MAX_FILES fail with ENOSPC in the volume only; a process that joins it
    finds its working folder there; the folder on the machine's disk stays empty, each group of folders is capped
    apart, and closing it frees everything. With a user namespace (Gradescope's container: root without
    CAP_SYS_ADMIN), and without one."""
    if holder == "a mount namespace alone":
        monkeypatch.setattr(volume, "HOLDER", NO_USER_NAMESPACE)
    held = _volume_or_skip(tmp_path)
    alone = os.stat(f"/proc/{held.pid}/ns/user").st_ino == os.stat("/proc/self/ns/user").st_ino
    try:
        assert alone == (holder == "a mount namespace alone")
        work, out = Path(held.seen(tmp_path / "work")), Path(held.seen(tmp_path / "out"))
        (work / "a").write_bytes(b"x" * 600 * 1024)
        joined = subprocess.run(
            [
                sys.executable,
                "-S",
                "-c",
                JOINS,
                os.path.dirname(volume.__file__),
                str(tmp_path / "work"),
                str(held.pid),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert joined.stdout.split() == ["['a']", str(tmp_path / "work")], joined.stderr
        with pytest.raises(OSError) as full:
            (work / "b").write_bytes(b"x" * 600 * 1024)  # two files, each under the cap, together over it
        assert volume.full(full.value)
        (out / "c").write_bytes(b"x" * 600 * 1024)  # what the ranks send back is capped apart
        assert os.listdir(tmp_path / "work") == []  # the machine's disk saw none of it
        (work / "b").unlink()
        (work / "a").unlink()
        if alone:
            return  # the files' cap is the tmpfs's, whichever namespace holds it
        made, folder = 0, os.open(work, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with pytest.raises(OSError) as full:
                for made in range(volume.MAX_FILES + 1):  # empty files: no bytes, each still costs the kernel an inode
                    os.close(os.open(str(made), os.O_CREAT | os.O_WRONLY, dir_fd=folder))
        finally:
            os.close(folder)
        assert volume.full(full.value) and volume.MAX_FILES - 10 < made < volume.MAX_FILES
    finally:
        held.close()
    assert not os.path.exists(f"/proc/{held.pid}")
    assert os.listdir(tmp_path / "work") == [] and os.listdir(tmp_path / "out") == []


def test_a_submission_that_fills_its_folders_fails_with_the_limit_and_leaves_nothing(
    tmp_path, monkeypatch, no_leftover_ranks
):
    """Twenty files of 0.8 MiB into the working folder under a 4 MiB cap: the check fails saying what was full and
    the limit, the other checks still run and say why they fail, the report names the volumes, and neither the
    grading's folder nor a holder survives it."""
    lab, roots = make_lab(tmp_path), []
    (tmp_path / "fills.py").write_text(FILLS)
    made = box.Box.__init__

    def kept(self, *args, **kwargs):
        made(self, *args, **kwargs)
        roots.append((self.root, self.volume and self.volume.pid))

    monkeypatch.setattr(box.Box, "__init__", kept)
    score = grade(lab, tmp_path / "fills.py", limits=Limits(disk_limit_mb=4))
    if "volumes of their own" not in score.sandbox:
        pytest.skip(f"this machine gives a grading no volume of its own: {score.sandbox}")
    total, hidden = score.results
    assert total.earned == 0 and total.message.startswith("the grading's folders are full"), total.message
    assert "at most 4 MiB and 65536 files in all (the grader's disk limit)" in total.message
    assert "No space left on device" in total.message and "fills.py line" in total.message
    assert "the grading's folders are full" in hidden.detail  # the next check (world size 1 again) says it too
    assert "4 MiB and 65536 files for what it writes" in score.sandbox
    ((root, holder),) = roots
    assert not root.exists(), "the grading's folder was left behind"
    assert not os.path.exists(f"/proc/{holder}"), "the volume's holder outlived its grading"


def test_without_a_volume_the_grading_says_its_folders_are_capped_per_file_only(tmp_path, monkeypatch, capsys):
    """Where the machine allows no namespace for a volume, the grading runs as before (each file capped) and the
    report and the instructor's terminal say the folders are not capped in all."""

    def refused(*args, **kwargs):
        raise volume.Unavailable(1, "unshare(CLONE_NEWNS): Operation not permitted")

    monkeypatch.setattr(volume.Volume, "__init__", refused)
    lab = make_lab(tmp_path)
    score = grade(lab, lab / "solution.py", quiet=False)
    assert score.total == score.maximum
    said = "its folders on the machine's disk, each file capped at 256 MiB but not the folders in all"
    assert said in score.sandbox and "Operation not permitted" in score.sandbox
    assert said in capsys.readouterr().err


@AT_SCALE
def test_a_class_where_one_student_fills_the_disk_grades_the_other_in_full(tmp_path):
    """Two students graded at once (--jobs 2, one process and sandbox each): the one that writes past the cap
    loses that check with the limit named; the other, beside it, scores full marks."""
    lab, students = make_lab(tmp_path), tmp_path / "class"
    students.mkdir()
    for name, source in (("filler", FILLS), ("honest", SOLUTION)):
        (students / f"{name}.py").write_text(source)
    feedback, scores = tmp_path / "feedback", tmp_path / "scores.csv"
    main(
        [
            str(lab),
            "--class",
            str(students),
            "--csv",
            str(scores),
            "--out",
            str(feedback),
            "--jobs",
            "2",
            "--disk-limit",
            "4",
        ]
    )
    rows = {line.split(",")[0]: float(line.split(",")[1]) for line in scores.read_text().splitlines()[1:]}
    assert rows == {"filler": 0.0, "honest": 3.0}, rows
    feedback = (tmp_path / "feedback" / "filler.json").read_text()
    assert "4 MiB and 65536 files in all" in feedback


def test_the_disk_limit_flag_refuses_a_size_that_is_not_positive(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(make_lab(tmp_path)), "--disk-limit", "0"])
    assert "--disk-limit must be a positive number of MiB, got 0" in capsys.readouterr().err


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
