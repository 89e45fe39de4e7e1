"""The project installs itself: pyproject, environment.yml, Makefile and CI agree."""

import os
import re
import subprocess
import sys

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement.strip(), maxsplit=1)[0].lower()


def test_environment_yml_lists_every_runtime_and_dev_dependency():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    wanted = {_name(r) for r in project["dependencies"]} | {_name(r) for r in project["optional-dependencies"]["dev"]}
    with open(os.path.join(ROOT, "environment.yml")) as f:
        listed = {_name(line.strip().lstrip("- ")) for line in f if line.strip().startswith("- ")}
    missing = wanted - listed
    assert not missing, f"environment.yml lacks {sorted(missing)}"


def test_readme_quick_start_and_ci():
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "make demo" in readme and "make test" in readme
    ci = os.path.join(ROOT, ".ci", "run")
    assert os.access(ci, os.X_OK) and "make test" in open(ci).read() and "make lint" in open(ci).read()


@pytest.mark.parametrize(
    "failing, says",
    [
        ((), ()),
        (("lint",), ("make lint failed",)),
        (("test",), ("make test failed",)),
        (("lint", "test"), ("make lint failed", "make test failed")),
    ],
)
def test_ci_runs_the_lint_and_the_tests_and_fails_when_either_fails(tmp_path, failing, says):
    """.ci/run with a stand-in `make` that records its targets and fails the ones named: both always run."""
    called = tmp_path / "called"
    make = tmp_path / "make"
    make.write_text(f'#!/bin/sh\necho "$1" >> {called}\ncase " {" ".join(failing)} " in *" $1 "*) exit 2;; esac\n')
    make.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run([os.path.join(ROOT, ".ci", "run")], capture_output=True, text=True, env=env, timeout=60)
    assert called.read_text().split() == ["lint", "test"]
    assert (out.returncode == 0) == (not failing), out
    assert all(line in out.stderr for line in says) and (says or out.stderr == ""), out.stderr


def test_command_line_help():
    out = subprocess.run([sys.executable, "-m", "toolkit", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "demo" in out.stdout and "grade" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "toolkit", "train-everything"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
