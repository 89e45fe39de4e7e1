"""What the benches share on the parent's side: putting a table into docs/benchmarks.md.

(The helpers a rank runs, such as the slowest rank's time, stay in each bench: ``toolkit.launch`` ships
a rank's function by value, and a module imported from bench/ is not importable on the ranks.)
"""

from __future__ import annotations

import os
import time


def write_section(path: str, title: str, command: str, body: str) -> None:
    """Put the section ``title`` (a "## " heading) into ``path``: replace an earlier one, keep every
    other section, a blank line before the next heading."""
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    section = f"{title}\n\n`{command}` ({time.strftime('%Y-%m-%d')})\n\n{body}\n"
    start = text.find(title)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + len(title))
        text = text[:start] + section + ("\n" + text[end + 1 :] if end >= 0 else "")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def append_table(path: str, command: str, text: str) -> None:
    """Add a run's table at the end of ``path``, under a "### " heading naming the command and the date."""
    with open(path, "a") as f:
        f.write(f"\n### `{command}` ({time.strftime('%Y-%m-%d')})\n\n{text}\n")
