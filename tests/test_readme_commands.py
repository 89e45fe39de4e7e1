"""The README's commands work as written, from the repository's folder, with no environment activated.

The trial: a new student followed the README on a fresh clone and every `python -m toolkit ...` failed with
"No module named 'torch'" (nothing says to activate .venv). The commands are now written
`.venv/bin/python -m toolkit ...`; here each is read out of README.md and run as written, in a fresh clone: a
folder holding exactly the files git would hand a student (tracked, or new and not ignored: no `runs/`, no build
leftovers), plus the `.venv` that `make setup` would build there, with `python` on the PATH being the system's and
no VIRTUAL_ENV. The commands import the clone's `toolkit` (the current folder comes first on `python -m`'s path),
so a file the commands need but git would not carry fails here. The long ones (`compare` trains every strategy,
and the other labs' grading takes the same path as lab 01's) run as far as their own `--help`; the others run whole.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PREFIX = ".venv/bin/python -m toolkit"
WHOLE = ("--help", "demo --quick", "simulate --model gpt3-175b", "grade labs/01-ring-allreduce", "release labs/")


def commands() -> list[str]:
    """Every `-m toolkit` command of the README: inline code and lines of bash blocks, prose placeholders
    ("python -m toolkit ...") left out."""
    spans = re.findall(r"```bash\n(.*?)```", README, re.S)
    lines = [line.split("  #")[0].strip() for block in spans for line in block.splitlines()]
    inline = re.findall(r"`([^`\n]*-m toolkit[^`\n]*)`", re.sub(r"```.*?```", "", README, flags=re.S))
    found = [c for c in lines + inline if "-m toolkit" in c and not c.endswith("...")]
    return list(dict.fromkeys(found))


def test_every_toolkit_command_in_the_readme_names_the_projects_interpreter():
    found = commands()
    assert len(found) >= 15, found
    wrong = [c for c in found if not c.startswith(PREFIX)]
    assert not wrong, f"these README commands need an activated environment: {wrong}"
    assert "source .venv/bin/activate" in README  # and the README says how plain `python` works too


def fresh_clone(where: Path) -> Path:
    """The files a clone of this tree would have (`git ls-files`: tracked and new-but-not-ignored, as the next
    commit holds them), copied into `where`, and the project's `.venv`."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True, timeout=60).stdout.decode().split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():  # a file deleted but not yet staged is listed too
            (where / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, where / name)
    (where / ".venv").symlink_to(ROOT / ".venv")
    return where


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    return fresh_clone(tmp_path_factory.mktemp("clone"))


def test_the_clone_is_what_git_carries_and_its_commands_import_its_own_toolkit(clone):
    assert (clone / "README.md").read_text() == README and (clone / "labs" / "01-ring-allreduce").is_dir()
    assert not (clone / "runs").exists() and not (clone / "toolkit.egg-info").exists()
    where = run(".venv/bin/python -c 'import toolkit; print(toolkit.__file__)'", clone).stdout.strip()
    assert Path(where) == clone / "toolkit" / "__init__.py", where


def run(command: str, where: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    argv = shlex.split(command.replace(" DIR", " released"))
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p)
    return subprocess.run(argv, cwd=where, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_readme_commands_run_as_written(clone):
    found = [c for c in commands() if "|" not in c and "--class" not in c]  # alternatives written a|b, a class folder
    ran, seen = [], set()
    for command in found:
        args = command[len(PREFIX):].strip()
        whole = next((w for w in WHOLE if args.startswith(w)), None)
        # `--help` reads no argument past the subcommand: `grade labs/02 --help` runs what `grade labs/01 --help`
        # did (a torch import, 3 s of CPU each); and a whole command is run whole once (its variants as --help)
        key = whole if whole and whole not in seen else args.split()[0] + " --help"
        if key in seen:
            continue
        seen.add(key)
        whole = key == whole
        done = run(command if whole else f"{command} --help", clone)
        out = done.stdout + done.stderr
        assert "No module named" not in out and "Traceback" not in out, (command, out[-3000:])
        if args.startswith("grade") and whole:  # the unsolved skeleton: graded, and it fails
            assert done.returncode == 1 and "Score: 0/" in out, (command, out[-3000:])
        else:
            assert done.returncode == 0, (command, out[-3000:])
        ran.append(args if whole else f"{args} --help")
    assert {w for w in WHOLE if any(r.startswith(w) for r in ran)} == set(WHOLE), ran
    assert (clone / "runs" / "sim-gpt3-175b-fsdp-512-report.html").exists()
    assert (clone / "released").is_dir()
