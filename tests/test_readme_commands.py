"""Every command of every Markdown file works as written, from the repository's folder, with nothing activated.

The trial: a new student followed the README on a fresh clone and every `python -m toolkit ...` failed with
"No module named 'torch'" (nothing says to activate .venv); then the labs' and docs' 34 commands did the same.
Commands are written `.venv/bin/python ...` or `make ...`; here each is read out of the Markdown files
(tests/doc_commands.py says what counts as a command, so a new document is covered with nothing to register)
and tried in a fresh clone: a folder holding exactly the files git would hand a student (tracked, or new and not
ignored: no `runs/`, no build leftovers), plus the `.venv` that `make setup` would build there, each command in a
fresh process with `python` on the PATH being the system's and no VIRTUAL_ENV. A command that fails says its file
and line.

How each is tried: a few run whole (`WHOLE`: the help, the collectives, a simulation, a grading, a release); every
other `.venv/bin/python` command runs as written up to the moment its own parser has accepted every argument
(tests/doc_dry_run.py: a renamed flag, a bad value or a missing file argument fails there); `make X` as
`make -n X` (the target exists, its recipe expands); other programs of .venv with `--help` added. The launchers of
a cluster and Conda are not on this machine (`doc_commands.ELSEWHERE`, each with its reason).
"""

from __future__ import annotations

import ast
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_commands import BARE, ELSEWHERE, Command, every_command  # noqa: E402

from toolkit.units import bytes_text  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PYTHON = ".venv/bin/python"
# run whole, once each (the first command that is exactly one of these, or starts with it and a space)
WHOLE = (
    ".venv/bin/python -m toolkit --help",
    ".venv/bin/python -m toolkit demo --quick",
    ".venv/bin/python -m toolkit simulate --model gpt3-175b --strategy fsdp --world-size 512",
    ".venv/bin/python -m toolkit grade labs/01-ring-allreduce",
    ".venv/bin/python -m toolkit release labs/ --out DIR",
)
PLACEHOLDERS = {"DIR": "released"}  # words of prose a reader replaces


def fresh_clone(where: Path) -> Path:
    """The files a clone of this tree would have (`git ls-files`: tracked and new-but-not-ignored, as the next
    commit holds them), copied into `where`, and a `.venv` with the project's packages (`project_venv`)."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
            timeout=60,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        if (ROOT / name).is_file():  # a file deleted but not yet staged is listed too
            (where / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, where / name)
    project_venv(where / ".venv")
    return where


def project_venv(venv: Path) -> None:
    """The `.venv` that `make setup` builds, without building it again: a real virtual environment of the same
    interpreter (a link to the project's would put its site-packages behind a path a grading's sandbox does not
    show its ranks) that reads the project's installed packages (a path in a .pth: not the project's editable
    install of toolkit, so the clone imports its own), and the project's commands (pip, jupyter, ...)."""
    home = Path(os.path.realpath(ROOT / ".venv" / "bin" / "python"))
    subprocess.run([str(home), "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    where = "import site; print(site.getsitepackages()[0])"
    ours, theirs = (
        subprocess.run(
            [str(python), "-c", where], capture_output=True, text=True, check=True, timeout=60
        ).stdout.strip()
        for python in (ROOT / ".venv/bin/python", venv / "bin/python")
    )
    (Path(theirs) / "project-venv.pth").write_text(ours + "\n")
    for tool in (ROOT / ".venv" / "bin").iterdir():
        if not (venv / "bin" / tool.name).exists():
            (venv / "bin" / tool.name).symlink_to(tool)


@pytest.fixture(scope="module")
def clone():
    """In runs/ (ignored by git), not under /tmp: a grading's sandbox has a private /tmp, where the clone's
    .venv (a link to the project's) would vanish from its ranks' sight, as a clone's real .venv never does."""
    (ROOT / "runs").mkdir(exist_ok=True)
    where = Path(tempfile.mkdtemp(prefix="doc-clone-", dir=ROOT / "runs"))
    yield fresh_clone(where)
    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture(scope="module")
def documented(clone):
    return every_command(clone)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p)
    return env


def _argv(command: Command) -> list[str]:
    return [PLACEHOLDERS.get(word, word) for word in command.argv]


def run(argv: list[str], where: Path, timeout: int = 600, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=where, env=_env(), capture_output=True, text=True, timeout=timeout, input=stdin)


def test_the_clone_is_what_git_carries_and_its_commands_import_its_own_toolkit(clone):
    assert (clone / "README.md").read_text() == README and (clone / "labs" / "01-ring-allreduce").is_dir()
    assert not (clone / "runs").exists() and not list(clone.glob("*.egg-info"))
    where = run([PYTHON, "-c", "import toolkit; print(toolkit.__file__)"], clone).stdout.strip()
    assert Path(where) == clone / "toolkit" / "__init__.py", where


def test_the_documents_commands_are_found_where_they_are(documented):
    """The finder sees the commands of every kind of document (a README's bash block, a lab's block without a
    language, inline code over a line break in docs/) and only commands (not a diagram, not a file's name)."""
    files = {c.file for c in documented}
    assert {
        "README.md",
        "labs/README.md",
        "labs/autograder/README.md",
        "docs/benchmarks.md",
        "labs/01-ring-allreduce/README.md",
    } <= files, files
    assert len(documented) >= 80, len(documented)
    by_text = {c.text: c for c in documented}
    assert ".venv/bin/python -m toolkit simulate --model gpt3-175b --strategy fsdp --world-size 512" in by_text
    assert (
        by_text[".venv/bin/python -m toolkit grade labs/12-pipeline --solution mine.py"].file
        == "labs/12-pipeline/README.md"
    )
    assert all(
        c.program.startswith(".venv/bin/") or c.program in ("make", *ELSEWHERE) or c.program in BARE for c in documented
    ), [str(c) for c in documented]


def test_every_documented_command_is_written_to_work_with_nothing_activated(clone, documented):
    wrong = [
        f"{c}  <- {c.program} is not on the PATH of a fresh shell: write .venv/bin/{c.program.split('/')[-1]}"
        for c in documented
        if c.program in BARE
    ]
    missing = [
        f"{c}  <- {c.program} does not exist in a fresh clone after make setup"
        for c in documented
        if c.program.startswith(".venv/bin/") and not (clone / c.program).exists()
    ]
    scripts = [
        f"{c}  <- no file {c.argv[1]} in the repository"
        for c in documented
        if c.program == PYTHON and not c.argv[1].startswith("-") and not (clone / c.argv[1]).is_file()
    ]
    problems = wrong + missing + scripts
    assert not problems, "\n".join(problems)
    assert "source .venv/bin/activate" in README  # and the README says how plain `python` works too


def _whole(documented) -> set[Command]:
    chosen = {}
    for c in documented:
        whole = next((w for w in WHOLE if c.text == w or c.text.startswith(w + " ")), None)
        if whole and whole not in chosen:
            chosen[whole] = c
    return set(chosen.values())


@pytest.mark.timeout(600)
def test_every_documented_command_accepts_its_arguments_as_written(clone, documented):
    """Every command not run whole below: its dry-run form, in a fresh clone, said with its file and line."""
    tried = [c for c in documented if c not in _whole(documented) and c.program not in ELSEWHERE]
    failed = []
    pythons = {}  # one dry run per distinct argv: the same command in several files is tried once
    for c in tried:
        if c.program == PYTHON and (
            (c.argv[1] == "-m" and c.argv[2].split(".")[0] == "toolkit") or not c.argv[1].startswith("-")
        ):
            pythons.setdefault(tuple(_argv(c)[1:]), []).append(c)
    if pythons:
        done = run([PYTHON, str(Path(__file__).parent / "doc_dry_run.py")], clone, stdin=json.dumps(list(pythons)))
        assert done.returncode == 0, done.stderr[-3000:]
        for (ok, said), where in zip(json.loads(done.stdout.splitlines()[-1]), pythons.values()):
            failed += [f"{c}\n{said.strip()[-1500:]}" for c in where if not ok]
    others = {}
    for c in tried:
        if c.program == "make":
            others.setdefault(("make", "-n", *_argv(c)[1:]), []).append(c)
        elif not any(c in cs for cs in pythons.values()):
            others.setdefault((*_argv(c), "--help"), []).append(c)
    for argv, where in others.items():
        done = run(list(argv), clone, timeout=120)
        if done.returncode != 0:
            failed += [
                f"{c}\n({shlex.join(argv)}: exit code {done.returncode})\n{(done.stdout + done.stderr)[-1500:]}"
                for c in where
            ]
    assert not failed, "\n\n".join(failed)
    assert len(pythons) >= 20 and len(others) >= 5, (len(pythons), len(others))


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_readme_commands_run_as_written(clone, documented):
    whole = sorted(_whole(documented), key=lambda c: (c.file, c.line))
    assert {next(w for w in WHOLE if c.text.startswith(w)) for c in whole} == set(WHOLE), [str(c) for c in whole]
    for command in whole:
        done = run(_argv(command), clone)
        out = done.stdout + done.stderr
        assert "No module named" not in out and "Traceback" not in out, f"{command}\n{out[-3000:]}"
        if command.argv[3] == "grade":  # the unsolved skeleton: graded, and it fails
            assert done.returncode == 1 and "Score: 0/" in out, f"{command}\n{out[-3000:]}"
        else:
            assert done.returncode == 0, f"{command}\n{out[-3000:]}"
    assert (clone / "runs" / "sim-gpt3-175b-fsdp-512-report.html").exists()
    assert (clone / "released").is_dir()


@pytest.mark.timeout(300)
def test_the_readmes_strategies_snippet_shows_what_its_comment_says(clone):
    """The trial: the snippet read the ledger after zero_grad() and showed "grads: 0" in a ZeRO-2 example. Run as
    written, in the fresh clone: every rank holds the whole parameters and a quarter of the gradients and
    optimizer states, the numbers its comment gives."""
    block = README.split("## Strategies", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    done = run([PYTHON, "-c", block], clone, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    held = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert len(held) == 4 and all(h == held[0] for h in held)
    assert held[0]["grads"] * 4 == held[0]["params"]  # fp32: a quarter of the gradients
    assert abs(held[0]["optimizer"] * 2 - held[0]["params"]) <= 64  # two fp32 moments of a quarter (+ padding)
    said = block.split("# each rank:")[1]
    for key in ("params", "grads", "optimizer"):
        assert f"{key} {bytes_text(held[0][key])}" in said, (key, held[0][key], said)


def test_a_bench_run_without_the_projects_interpreter_says_why_it_failed():
    """The trial: `python bench/launch.py` on a fresh clone ended in "RuntimeError: fresh at world 2 with 0
    launches ended with 1", the measured process's "No module named ..." nowhere. Its stderr is now in the error."""
    python = shutil.which("python3", path=_env()["PATH"])
    if (
        python is None
        or subprocess.run([python, "-c", "import toolkit"], capture_output=True, env=_env(), cwd="/").returncode == 0
    ):
        pytest.skip("no system python3 without the toolkit to run the bench with")
    done = run([python, "bench/launch.py", "--worlds", "1", "--next", "1", "--repeats", "1"], ROOT, timeout=120)
    assert done.returncode != 0 and "launches ended with 1:" in done.stderr, done.stderr[-2000:]
    cause = done.stderr.split("launches ended with 1:", 1)[1]
    assert "No module named" in cause, done.stderr[-2000:]
