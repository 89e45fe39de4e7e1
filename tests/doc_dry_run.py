"""The dry-run form of a documented `.venv/bin/python ...` command: run it as written, up to the moment its own
argument parser has read every argument, then stop (tests/test_readme_commands.py).

A program that reads its options with argparse (the toolkit's commands, every bench/ script) is run in this
process with the command's argv, as `python -m MODULE` or `python SCRIPT` would run it; the first
`parse_args` that reads the command's last arguments is the program's own, and once it has accepted them
(an unknown option, a bad value or a missing argument is argparse's error, exit code 2) nothing more runs.
One interpreter for every command: torch is imported once, not once per command.

stdin: a JSON list of argvs (without `.venv/bin/python`); stdout: a JSON list of [ok, what was said].
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import runpy
import sys


class Parsed(BaseException):
    """The program's parser accepted every argument: the dry run ends here."""


_parse_args = argparse.ArgumentParser.parse_args


def _parse_and_stop(self, args=None, namespace=None):
    result = _parse_args(self, args, namespace)
    given, rest = list(sys.argv[1:] if args is None else args), sys.argv[1:]
    if given == rest[len(rest) - len(given) :]:  # it read the command's last arguments: the program's own parser
        raise Parsed
    return result


def dry_run(argv: list[str]) -> tuple[bool, str]:
    said = io.StringIO()
    path = list(sys.path)
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                sys.path[0] = os.getcwd()
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(argv)
                sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
                runpy.run_path(argv[0], run_name="__main__")
        return False, said.getvalue() + "\n(it ran to its end: its parser never read the arguments)"
    except Parsed:
        return True, said.getvalue()
    except SystemExit as done:
        return done.code in (0, None), said.getvalue() + f"\n(exit code {done.code})"
    except BaseException as exc:  # noqa: BLE001 - said, with the command
        return False, said.getvalue() + f"\n{type(exc).__name__}: {exc}"
    finally:
        sys.path[:] = path


if __name__ == "__main__":
    argparse.ArgumentParser.parse_args = _parse_and_stop
    print(json.dumps([dry_run(argv) for argv in json.load(sys.stdin)]))
