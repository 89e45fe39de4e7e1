"""Every command a Markdown file of the repository shows, with its file and line (tests/test_readme_commands.py).

What counts as a command, so that a new document is covered with nothing to register:
- every line of a ```bash / ```sh / ```shell / ```console block (a `\\` continues it on the next line, `$ ` and a
  trailing `# comment` are dropped);
- a line of a block with no language (the labs' READMEs) that starts with a program below;
- inline code (`...`, over line breaks too) that starts with a program below (after `NAME=value` settings),
  has an argument, and does not end in "..." (a placeholder in prose: "plain `python -m toolkit ...`").
Programs: the project's own (`.venv/bin/...`), `make`, and those a reader would type bare and must not
(`python`, `pip`, `jupyter`, ...: they need an activated environment), and the launchers of a cluster or of
Conda, which are not on the course's machine (`ELSEWHERE`).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

SHELL_BLOCKS = ("bash", "sh", "shell", "console")
BARE = ("python", "python3", "pip", "pip3", "jupyter", "jupytext", "pytest", "ruff")  # need an activated environment
ELSEWHERE = {  # program -> why the test does not run it here
    "torchrun": "a cluster's launcher, of the reader's train.py",
    "mpirun": "a cluster's launcher, of the reader's train.py",
    "mpiexec": "a cluster's launcher, of the reader's train.py",
    "srun": "a cluster's launcher, of the reader's train.py",
    "conda": "Conda is not the course machine's environment (environment.yml is checked by tests/test_setup.py)",
}
PROGRAMS = (".venv/bin/", "make", *BARE, *ELSEWHERE)


@dataclass(frozen=True)
class Command:
    file: str  # relative to the repository
    line: int
    text: str  # as written, on one line, without its comment

    @property
    def argv(self) -> list[str]:
        return [word for word in shlex.split(self.text) if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", word)]

    @property
    def program(self) -> str:
        return self.argv[0]

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.text}"


def _starts_with_program(text: str) -> bool:
    try:
        words = shlex.split(text)
    except ValueError:
        return False
    words = [w for w in words if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", w)]
    if len(words) < 2:
        return False
    first = words[0]
    return first.startswith(".venv/bin/") or first in PROGRAMS


def _without_comment(line: str) -> str:
    line = re.sub(r"^\s*\$ ", "", line)
    return re.split(r"\s#(?=[^'\"]*$)", line, maxsplit=1)[0].strip() if "#" in line else line.strip()


def commands_in(path: Path, root: Path) -> list[Command]:
    name, lines = str(path.relative_to(root)), path.read_text().splitlines()
    found, fence, prose = [], None, []
    i = 0
    while i < len(lines):
        line = lines[i]
        opening = re.match(r"^\s*```\s*([\w-]*)", line)
        if opening:
            fence = None if fence is not None else opening.group(1).lower()
            prose.append("")
            i += 1
            continue
        if fence is None:
            prose.append(line)
            i += 1
            continue
        prose.append("")  # keeps the prose's line numbers
        start, text = i + 1, line
        while text.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            prose.append("")
            text = text.rstrip()[:-1] + " " + lines[i].strip()
        text = " ".join(_without_comment(text).split())
        if text and (fence in SHELL_BLOCKS or (fence == "" and _starts_with_program(text))):
            found.append(Command(name, start, text))
        i += 1
    joined = "\n".join(prose)
    for match in re.finditer(r"(?<!`)`([^`]+)`(?!`)", joined):
        text = " ".join(match.group(1).split())
        if _starts_with_program(text) and not text.endswith("..."):
            found.append(Command(name, joined.count("\n", 0, match.start()) + 1, text))
    return sorted(found, key=lambda c: c.line)


def markdown_files(root: Path) -> list[Path]:
    """The Markdown files of `root`, a fresh clone (whatever git carries; nothing under a hidden folder such as
    .venv)."""
    return sorted(p for p in root.rglob("*.md") if not any(part.startswith(".") for part in p.relative_to(root).parts))


def every_command(root: Path) -> list[Command]:
    return [c for path in markdown_files(root) for c in commands_in(path, root)]
