"""The project installs itself: pyproject, environment.yml, Makefile and CI agree."""

import os
import re
import subprocess
import sys

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
    assert os.access(ci, os.X_OK) and "make test" in open(ci).read()


def test_command_line_help():
    out = subprocess.run([sys.executable, "-m", "toolkit", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "demo" in out.stdout and "grade" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "toolkit", "train-everything"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
